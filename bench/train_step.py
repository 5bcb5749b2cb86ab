"""Training-step throughput: GRPO on captured groups vs TRL's GRPOTrainer generating its own completions.

    python -m bench.train_step                     # tiny model, CPU, 3 x both modes (~3 min on 2 busy cores)
    python -m bench.train_step --repeats 1 --groups 8 --completion-tokens 64 --json-out train_step.json
    python -m bench.train_step --model /path/to/Qwen2.5-0.5B-Instruct   # a real model (bf16 on a GPU)
    # ragged completions, with and without a token budget, on a random Qwen2-1.5B shape (one H100):
    python -m bench.train_step --shape 1.5b --groups 16 --completion-tokens 512 --min-completion-tokens 64 \
        --max-tokens-per-micro-batch 16384 --peak-tflops 989 --repeats 1

``--shape 0.5b`` / ``1.5b`` builds a random Qwen2 of Qwen2.5's shape with the tiny tokenizer and a
151,936-row vocabulary (nothing downloaded; bf16 on a GPU). ``--min-completion-tokens`` draws each
completion's length between it and ``completion_tokens`` (padding to measure);
``--max-tokens-per-micro-batch`` adds a third mode, ``budget``: the captured round under that
``GRPOArgs.max_tokens_per_micro_batch``, against ``captured`` (None) in the same run. Reported per
mode besides the below: ``padding_frac`` (of the positions the forwards processed, padding),
and ``mfu`` = 6 x parameters x tokens/s / ``--peak-tflops`` (the 6N convention; LoRA skips the
frozen weights' gradients, so the model does less than that: a comparison figure).

Both modes train the same model with the same LoRA (r 16, all linear layers), batch shape
(``groups`` prompts x ``group_size`` completions, ``per_device_train_batch_size`` = one group,
``gradient_accumulation_steps``), completion length and number of optimizer steps:

- ``captured``: ``flywheel.trainer.grpo.train_round`` on pre-built groups whose completions (random
  tokens, exactly ``completion_tokens`` long, with behaviour logprobs) stand in for traffic
  the gateway captured;
- ``generate``: TRL's ``GRPOTrainer`` sampling its completions with ``model.generate``
  (``max_completion_length = completion_tokens``; the random tiny model never emits eos, so
  every completion is full length and both modes train on the same number of tokens).

Each mode runs in its own child process, so its peak memory is its own. Reported per mode:
``tokens_per_s`` = (prompt + completion tokens trained) / ``trainer.train()`` wall time,
the median optimizer-step time after the first, the peak RSS of the process
(``resource.getrusage``: libraries, weights, activations, optimizer state: everything), and on
GPU ``torch.cuda.max_memory_allocated``. (Not ``tracemalloc``: it does not see tensor storage,
and tracing every Python allocation slowed the captured round ~20x here, which is no measurement.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the children run as `python -m bench.train_step` from here


@dataclass
class Args:
    groups: int = 4
    """distinct prompts (groups) per round"""
    group_size: int = 8
    """completions per prompt (TRL's num_generations)"""
    completion_tokens: int = 32
    """completion length (captured: exact; generate: max_completion_length, reached by the tiny model)"""
    gradient_accumulation_steps: int = 2
    """micro-batches (of one group each) per optimizer step"""
    steps: int = 8
    """optimizer steps per mode"""
    model: str = ""
    """model directory; empty: build the --shape model in a temporary directory"""
    shape: str = "tiny"
    """tiny | 0.5b | 1.5b: the random model built when --model is empty"""
    min_completion_tokens: int = 0
    """shortest completion (captured: drawn uniformly up to completion_tokens); 0: all completion_tokens long"""
    max_tokens_per_micro_batch: int = 0
    """> 0: also run the captured round under this token budget (mode budget)"""
    peak_tflops: float = 0.0
    """the device's peak dense TFLOPS in the training dtype (H100 SXM bf16: 989); > 0 reports MFU"""
    seed: int = 0
    """seeds data, LoRA init and sampling"""
    threads: int = 0
    """torch CPU threads per child (0: torch's default); 1 is steadier on a machine shared with other jobs"""
    repeats: int = 3
    """pairs of runs (captured then generate); medians are reported: CI machines share their cores"""
    mode: str = "both"
    """both (parent: runs the children and compares) | captured | budget | generate (one child)"""
    json_out: str = ""
    """also write the results here as JSON"""
    compare: str = ""
    """modes the parent runs, comma-separated (empty: captured, budget when set, generate)"""


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        default = getattr(Args, f.name)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    return Args(**vars(parser.parse_args(argv)))


def questions(n: int) -> list[str]:
    return [f"Question {i}: what is the weather in city number {i} today?" for i in range(n)]


# Qwen2.5's shapes (config.json of Qwen2.5-0.5B / 1.5B-Instruct): hidden, layers, heads, KV heads, MLP width
SHAPES = {"0.5b": (896, 24, 14, 2, 4864), "1.5b": (1536, 28, 12, 2, 8960)}
QWEN_VOCAB = 151_936


def build_shaped_model(path: Path, shape: str, seed: int) -> Path:
    """A random Qwen2 of a Qwen2.5 shape with the tiny tokenizer: real cost per token, nothing downloaded."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from flywheel.trainer.tiny_model import build_tiny_model

    build_tiny_model(path, seed=seed)  # the tokenizer and its ids (all < 1,540, inside the larger vocabulary)
    tiny = Qwen2Config.from_pretrained(path)
    hidden, layers, heads, kv_heads, mlp = SHAPES[shape]
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=mlp,
                         max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=tiny.bos_token_id,
                         eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id)
    torch.manual_seed(seed)
    model: Any = Qwen2ForCausalLM(config)
    model = model.to(dtype=torch.bfloat16).eval()
    model.generation_config = GenerationConfig.from_pretrained(path)
    model.save_pretrained(path)
    return path


def parameter_count(model: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


def grpo_args(args: Args, **extra: Any) -> Any:
    from flywheel.trainer.grpo_args import GRPOArgs

    return GRPOArgs.tiny(max_steps=args.steps, num_generations=args.group_size,
                         gradient_accumulation_steps=args.gradient_accumulation_steps,
                         max_completion_tokens=args.completion_tokens, seed=args.seed, progress=False,
                         precision="auto", **extra)


def peaks() -> dict[str, float]:
    import torch

    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if torch.cuda.is_available():
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def step_times(log_history: list[dict[str, Any]]) -> float:
    times = [h["step_time"] for h in log_history if "step_time" in h][1:]  # the first step warms up
    return statistics.median(times) if times else float("nan")


# --------------------------------------------------------------------------- captured: flywheel.trainer.grpo


def run_captured(args: Args, budget: int | None = None) -> dict[str, Any]:
    import peft  # noqa: F401  (imported up front: round_seconds should not count library imports)
    import trl  # noqa: F401
    from transformers import AutoTokenizer

    from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
    from flywheel.trainer.grpo import train_round

    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    groups = []
    for g, question in enumerate(questions(args.groups)):
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        members = []
        for m in range(args.group_size):
            length = rng.randint(args.min_completion_tokens or args.completion_tokens, args.completion_tokens)
            completion = [rng.choice(vocab) for _ in range(length)]
            turn = BranchTurn(messages, {"role": "assistant", "content": tokenizer.decode(completion)},
                              prompt_token_ids=prompt, completion_token_ids=completion,
                              completion_logprobs=[-7.0] * len(completion), finish_reason="length")
            members.append(GroupMember(f"t{g}-{m}", [turn], reward=rng.random()))
        groups.append(TrainingGroup(f"g{g}", "explicit", "bench", members))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        result = train_round(args.model, groups, grpo_args(args, max_tokens_per_micro_batch=budget),
                             out_dir=Path(tmp) / "1")
        wall = time.perf_counter() - started
        memory = peaks()
        history = json.loads((Path(tmp) / "1" / "flywheel_round.json").read_text())["steps"]
    seconds = result.metrics["charts/train_seconds"]
    return {"mode": "captured" if budget is None else "budget", "steps": result.metrics["charts/steps"],
            "train_seconds": seconds, "round_seconds": wall, "tokens": result.metrics["charts/tokens_per_s"] * seconds,
            "tokens_per_s": result.metrics["charts/tokens_per_s"], "median_step_s": step_times(history),
            "loss": result.metrics["losses/loss"], "padding_frac": result.metrics["samples/padding_frac"], **memory}


# --------------------------------------------------------------------------- generate: TRL alone


def run_generate(args: Args) -> dict[str, Any]:
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from flywheel.trainer.round_trainer import target_modules

    settings = grpo_args(args)
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    transformers.set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if bf16 else torch.float32)
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                      target_modules=target_modules(model, "all-linear"), task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in questions(args.groups)])

    # dense and cheap (docs/engineering-notes.md)
    def letter_a(completions: list[Any], **kwargs: Any) -> list[float | None]:
        texts = [c[0]["content"] for c in completions]
        return [t.count("a") / max(1, len(t)) for t in texts]

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(output_dir=tmp, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                            seed=args.seed, bf16=bf16, use_cpu=not cuda, learning_rate=settings.learning_rate,
                            lr_scheduler_type="constant", max_steps=args.steps,
                            per_device_train_batch_size=args.group_size,
                            gradient_accumulation_steps=args.gradient_accumulation_steps,
                            num_generations=args.group_size, max_completion_length=args.completion_tokens,
                            temperature=1.0, loss_type=settings.loss_type, mask_truncated_completions=False,
                            log_completions=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[letter_a], args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora)
        trainer.remove_callback(PrinterCallback)
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        memory = peaks()
    history = trainer.state.log_history
    seconds = next(h["train_runtime"] for h in history if "train_runtime" in h)
    tokens = trainer.state.num_input_tokens_seen  # prompt + completion tokens, all ranks
    losses = [h["loss"] for h in history if "loss" in h]
    return {"mode": "generate", "steps": trainer.state.global_step, "train_seconds": seconds, "round_seconds": wall,
            "tokens": tokens, "tokens_per_s": tokens / seconds, "median_step_s": step_times(history),
            "loss": sum(losses) / len(losses), "padding_frac": float("nan"), **memory}  # TRL's forwards: not counted


# --------------------------------------------------------------------------- parent: both, side by side


def main() -> None:
    args = parse_args()
    if args.threads > 0 and args.mode != "both":
        import torch

        torch.set_num_threads(args.threads)
    if args.mode in ("captured", "budget"):
        print(json.dumps(run_captured(args, args.max_tokens_per_micro_batch if args.mode == "budget" else None)))
        return
    if args.mode == "generate":
        print(json.dumps(run_generate(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model and args.shape == "tiny":
            from flywheel.trainer.tiny_model import build_tiny_model

            args.model = str(build_tiny_model(Path(tmp) / "tiny", seed=args.seed))
        elif not args.model:
            args.model = str(build_shaped_model(Path(tmp) / args.shape, args.shape, args.seed))
        modes = args.compare.split(",") if args.compare else \
            ["captured", *(["budget"] if args.max_tokens_per_micro_batch > 0 else []), "generate"]
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        params = parameter_count(args.model)
        for _ in range(args.repeats):
            for mode in modes:
                child = [sys.executable, "-m", "bench.train_step", "--mode", mode,
                         *[x for f in fields(Args) if f.name != "mode"
                           for x in (f"--{f.name.replace('_', '-')}", str(getattr(args, f.name)))]]
                done = subprocess.run(child, capture_output=True, text=True, check=False, cwd=ROOT)
                if done.returncode != 0:
                    raise SystemExit(f"{mode} failed:\n{done.stderr[-4000:]}")
                runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians: dict[str, dict[str, Any]] = {
        mode: {key: statistics.median(r[key] for r in runs[mode]) if key != "mode" else mode for key in runs[mode][0]}
        for mode in modes}
    for r in medians.values():
        r["mfu"] = 6 * params * r["tokens_per_s"] / (args.peak_tflops * 1e12) if args.peak_tflops > 0 else None
    summary: dict[str, Any] = {"args": asdict(args), "parameters": params, **medians, "runs": runs}
    if "generate" in runs:  # ratios of runs made back to back (same machine load), then their median
        pairs = list(zip(runs["captured"], runs["generate"], strict=True))
        summary["tokens_per_s_ratio"] = statistics.median(c["tokens_per_s"] / g["tokens_per_s"] for c, g in pairs)
        summary["step_time_ratio"] = statistics.median(g["median_step_s"] / c["median_step_s"] for c, g in pairs)
    if "budget" in runs:
        summary["budget_tokens_per_s_ratio"] = statistics.median(
            b["tokens_per_s"] / c["tokens_per_s"] for c, b in zip(runs["captured"], runs["budget"], strict=True))
    memory = "peak CUDA MiB" if "cuda_max_allocated_mib" in medians["captured"] else "peak RSS MiB"
    print(f"{args.model} ({params / 1e6:.1f}M parameters)")
    print(f"{'mode':<10}{'tokens/s':>12}{'padding':>9}{'MFU':>8}{'median step s':>15}{'train s':>10}{'round s':>10}"
          f"{memory:>15}")
    for r in medians.values():
        peak = r.get("cuda_max_allocated_mib", r["peak_rss_mib"])
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        padding = f"{r['padding_frac']:.1%}" if math.isfinite(r["padding_frac"]) else "-"
        print(f"{r['mode']:<10}{r['tokens_per_s']:>12.0f}{padding:>9}{mfu:>8}{r['median_step_s']:>15.3f}"
              f"{r['train_seconds']:>10.2f}{r['round_seconds']:>10.2f}{peak:>15.0f}")
    print(f"medians of {args.repeats} runs each")
    if "generate" in runs:
        print(f"captured / generate tokens/s: {summary['tokens_per_s_ratio']:.2f}x, step time generate / captured: "
              f"{summary['step_time_ratio']:.2f}x (medians of back-to-back pairs)")
    if "budget" in runs:
        print(f"budget / captured tokens/s: {summary['budget_tokens_per_s_ratio']:.2f}x (back-to-back pairs)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
