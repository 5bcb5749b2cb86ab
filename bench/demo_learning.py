"""The `flywheel demo` loop, offline, on our training path: how fast does the demo task learn?

    python -m bench.demo_learning                                    # recommended settings, 10 min of loop clock
    python -m bench.demo_learning --grpo '{"learning_rate": 3e-3}' --tag lr3e-3 --log runs.jsonl
    python -m bench.demo_learning --rounds 0                         # only the warm start's rates
    python -m bench.demo_learning --without-replacement              # a group's first turns drawn without replacement
    python -m bench.demo_learning --without-replacement --inclusion-weights  # ... weighted by p / q (unbiased)
    python -m bench.demo_learning --measure-child --rounds 1         # also time a round as a fresh child process
    python -m bench.demo_learning --measure-gateway 64 --rounds 0    # CPU per episode of a real gateway + agent

What each round does, as the gateway's loop will (examples/demo/task.py is the task):

1. sample episodes with the current policy (the warm start, then the latest adapter):
   ``group_size`` attempts at each of ``groups_per_round`` requests from the training pool
   (the same-task groups the gateway forms), first turn then, after a well-formed call, the
   tool result and the final answer; temperature ``temperature``, plain ``generate``, exact
   token ids and behaviour logprobs kept as the engine reports them (``--without-replacement``: a
   group's first turns are the four largest Gumbel-perturbed sequences, docs/learning.md);
2. reward each episode with ``task.episode_reward`` and build the ``TrainingGroup`` s the
   gateway's capture would hand the trainer (two turns per member, exact ids, logprobs);
3. ``flywheel.trainer.grpo.train_round`` on them, continuing from the previous round's adapter and
   optimizer state (``GRPOArgs.tiny()`` + ``--grpo``);
4. evaluate the new adapter on held-out requests: the right-tool rate of ``eval_samples``
   first turns at temperature 1 and of one greedy answer per request, and the format rate
   (one well-formed call, ended by its end-of-turn token: a collapsed model scores 0).

The loop clock adds up what the loop would spend, in CPU seconds (the benchmark machines are
shared: wall time would measure the other jobs): each round's episodes at ``episode_cost_s``
(what the gateway and its store process spend serving one episode of the agent, measured with
``--measure-gateway``: this script's batched sampling is far cheaper than serving requests one
by one), the round's training (``train_round`` here, one torch thread) and ``round_overhead_s``
(the training child process's imports and model load, measured with ``--measure-child``).
Evaluation is not counted. Printed: one line per round, then the right-tool rate after
2/5/8 minutes of loop clock.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from examples.demo import task
from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup
from flywheel.gateway.cli.demo import small_model_train_args
from flywheel.gateway.core.processes import NotAnswering, free_port, wait_until_answering
from flywheel.gateway.serving.engines.local.beams import log_inclusion, perturbed_children
from flywheel.gateway.serving.engines.local.toolcalls import parse_tool_calls
from flywheel.trainer.samples import centred_rewards

ROOT = Path(__file__).resolve().parent.parent
MARKS_MIN = (2.0, 5.0, 8.0)  # loop-clock minutes at which the summary reads the curve
COLLAPSED_FORMAT_RATE = 0.5  # below this share of well-formed first turns a candidate counts as collapsed


@dataclass
class Args:
    grpo: str = "{}"
    """GRPOArgs overrides as JSON, on top of GRPOArgs.tiny() and DEFAULT_GRPO (what [train.args] would hold)"""
    group_size: int = 4
    """attempts per request: the size of a same-task group"""
    groups_per_round: int = 16
    """requests (groups) sampled and trained per round"""
    temperature: float = 1.0
    """sampling temperature of the episodes (GRPOArgs.temperature follows it)"""
    pool: int = 64
    """distinct training requests the agent cycles through"""
    eval_requests: int = 64
    """distinct held-out requests for evaluation"""
    eval_samples: int = 256
    """first turns sampled at temperature 1 per evaluation (spread over the held-out requests)"""
    minutes: float = 10.0
    """loop-clock budget: no round starts after it"""
    rounds: int = 100
    """at most this many rounds (0: evaluate the warm start only)"""
    episode_cost_s: float = 0.4
    """CPU seconds the gateway + store process spend per episode (--measure-gateway)"""
    round_overhead_s: float = 8.0
    """CPU seconds a round costs beyond training: the child process's imports and model load (--measure-child)"""
    warm_start_steps: int = 80
    """steps of the format-only warm start (cached under --out)"""
    warm_start_examples: int = 512
    """distinct warm-start conversations"""
    warm_start_batch: int = 16
    """warm-start conversations per step"""
    warm_start_lr: float = 6e-3
    """warm-start AdamW learning rate"""
    out: str = "/tmp/flywheel-demo-learning"
    """working directory: tiny model, warm starts, each run's adapters"""
    tag: str = ""
    """a name for this run in the log"""
    log: str = ""
    """append the run (settings, every round, summary) as one JSON line to this file"""
    measure_child: bool = False
    """also run round 1 again as `python -m flywheel.trainer.grpo` in a fresh process; report its wall and CPU"""
    measure_gateway: int = 0
    """serve the warm start with `python -m flywheel.gateway serve`, run this many agent episodes, report their cost"""
    threads: int = 1
    """torch CPU threads (0: torch's default)"""
    seed: int = 0
    """seeds pools, warm start, sampling and training"""
    without_replacement: bool = False
    """draw each group's first turns without replacement (stochastic beam search) instead of independently"""
    inclusion_weights: bool = False
    """with --without-replacement: weight each member by p/q, its probability over its inclusion probability"""


# What `flywheel demo` trains with, unless --grpo says otherwise (docs/demo.md: the runs that chose it).
DEFAULT_GRPO: dict[str, Any] = {**small_model_train_args(), "progress": False}


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        default = getattr(Args, f.name)
        if isinstance(default, bool):
            parser.add_argument(f"--{f.name.replace('_', '-')}", action="store_true")
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    return Args(**vars(parser.parse_args(argv)))


# --------------------------------------------------------------------------- sampling


@dataclass
class Turn:
    """One sampled turn as the engine would report it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the end-of-turn token, when one came
    logprobs: list[float]
    message: dict[str, Any]  # the response message: content and parsed tool calls
    truncated: bool  # no end-of-turn token within max_tokens

    def branch_turn(self, messages: list[dict[str, Any]]) -> BranchTurn:
        finish = "tool_calls" if self.message.get("tool_calls") else "length" if self.truncated else "stop"
        return BranchTurn(request_messages=messages, response_message=self.message, tools=task.TOOLS,
                          prompt_token_ids=self.prompt_ids, completion_token_ids=self.completion_ids,
                          completion_logprobs=self.logprobs, finish_reason=finish)


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Prompt ids as the local engine makes them (gateway/serving/engines/local/prompts.py)."""
    from flywheel.gateway.serving.engines.local.prompts import render_chat, template_messages

    return render_chat(tokenizer, template_messages(messages), task.TOOLS, {})


def sample(model: Any, tokenizer: Any, prompts: list[list[int]], *, max_tokens: int, temperature: float,
           seed: int) -> list[Turn]:
    """One completion per prompt, batched (left padding); logprobs are log_softmax(logits / T) as the engine's."""
    import torch
    from transformers import GenerationConfig

    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}  # the tiny model's generation_config stops on both
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    greedy = temperature == 0
    config = GenerationConfig(do_sample=not greedy, temperature=None if greedy else temperature, top_k=None,
                              top_p=None, max_new_tokens=max_tokens, eos_token_id=sorted(eos), pad_token_id=pad,
                              output_logits=True, return_dict_in_generate=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    tokens = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1).gather(-1, tokens[..., None])[..., 0]
    turns = []
    for row, prompt in enumerate(prompts):
        ids = tokens[row].tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
        ids = ids[:end] if end else ids
        turns.append(as_turn(tokenizer, prompt, ids, logprobs[row, :len(ids)].tolist(), ended=end is not None,
                             max_tokens=max_tokens))
    return turns


def as_turn(tokenizer: Any, prompt: list[int], ids: list[int], logprobs: list[float], *, ended: bool,
            max_tokens: int) -> Turn:
    """A sampled completion as the engine reports it: text parsed into content and tool calls."""
    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    text = tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
    content, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    # As the agent judges it: a turn that used all its max_tokens counts as cut (examples/demo/agent.py: ask).
    return Turn(prompt, ids, logprobs, message, truncated=not ended or len(ids) >= max_tokens)


def sample_without_replacement(model: Any, tokenizer: Any, prompt: list[int], k: int, *, max_tokens: int,
                               temperature: float, generator: Any) -> tuple[list[Turn], list[float]]:
    """``k`` distinct completions of ``prompt`` drawn without replacement: stochastic beam search (Kool, van
    Hoof & Welling 2019), the ``k`` largest Gumbel-perturbed sequence log-probabilities, found beam by beam
    with the engine's math (``beams.perturbed_children``, ``beams.log_inclusion``); and each one's log
    importance weight ``phi - log q(kappa)``, which ``trainer.samples.centred_rewards`` weighs by.

    Each beam keeps its log-probability ``phi`` and perturbed value ``g``; a child's perturbed value is drawn
    conditioned on its siblings' maximum being the parent's (the paper's appendix B, in its stable form).
    ``kappa``, the largest perturbed value left out, is the (k+1)-th largest of all sequences: a sequence is
    in the sample with probability ``q = 1 - exp(-exp(phi - kappa))`` given it (the paper's section 4).
    No key-value cache: every step forwards the whole sequences (fine for the tiny model's short turns).
    """
    import torch

    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    beams: list[dict[str, Any]] = [{"ids": [], "logps": [], "phi": 0.0, "g": 0.0, "done": False}]
    kappa = float("-inf")
    for _ in range(max_tokens):
        live = [b for b in beams if not b["done"]]
        if not live:
            break
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + b["ids"] for b in live])).logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        phi = torch.tensor([b["phi"] for b in live])[:, None] + logp
        g = perturbed_children(torch.tensor([b["g"] for b in live])[:, None], phi, generator)
        top = torch.topk(g, k + 1, dim=-1)
        kappa = max(kappa, top.values[:, k].max().item())  # each row's best child left out
        children = [b for b in beams if b["done"]]
        for row, beam in enumerate(live):
            for value, token in zip(top.values[row, :k].tolist(), top.indices[row, :k].tolist(), strict=True):
                children.append({"ids": beam["ids"] + [token], "logps": beam["logps"] + [logp[row, token].item()],
                                 "phi": phi[row, token].item(), "g": value, "done": token in eos})
        ranked = sorted(children, key=lambda b: b["g"], reverse=True)
        beams, left = ranked[:k], ranked[k:]
        kappa = max([kappa] + [b["g"] for b in left])
    turns = [as_turn(tokenizer, prompt, b["ids"], b["logps"], ended=b["done"], max_tokens=max_tokens) for b in beams]
    return turns, [b["phi"] - log_inclusion(b["phi"], kappa) for b in beams]


@dataclass
class Episodes:
    """A round's sampled episodes as training groups, and what they scored."""

    groups: list[TrainingGroup]
    rewards: list[float] = field(default_factory=list)
    right_tool: list[bool] = field(default_factory=list)
    well_formed: list[bool] = field(default_factory=list)


def run_episodes(model: Any, tokenizer: Any, requests: list[task.Request], *, group_size: int, temperature: float,
                 seed: int, tag: str, without_replacement: bool = False, inclusion_weights: bool = False) -> Episodes:
    """``group_size`` episodes of each request: first turn, then tool result and final answer after a valid call."""
    import torch

    firsts = [task.first_messages(r) for r in requests]
    prompts = [render(tokenizer, m) for m in firsts]
    rows = [(i, k) for i in range(len(requests)) for k in range(group_size)]
    if without_replacement:
        generator = torch.Generator().manual_seed(seed)
        drawn = [sample_without_replacement(model, tokenizer, prompt, group_size, max_tokens=task.FIRST_TURN_MAX_TOKENS,
                                            temperature=temperature, generator=generator) for prompt in prompts]
        turns1 = [turn for turns, _ in drawn for turn in turns]
        log_weights = [lw for _, lws in drawn for lw in lws]
    else:
        turns1 = sample(model, tokenizer, [prompts[i] for i, _ in rows], max_tokens=task.FIRST_TURN_MAX_TOKENS,
                        temperature=temperature, seed=seed)
    called = [task.called_tool(t.message, truncated=t.truncated) for t in turns1]
    seconds: dict[int, list[dict[str, Any]]] = {}  # row -> messages of the second turn
    for j, ((i, _), turn, tool) in enumerate(zip(rows, turns1, called, strict=True)):
        if tool is not None:
            call_id = turn.message["tool_calls"][0]["id"]
            seconds[j] = [*firsts[i], turn.message, {"role": "tool", "tool_call_id": call_id,
                                                     "content": task.tool_result(tool)}]
    turns2 = dict(zip(seconds, sample(model, tokenizer, [render(tokenizer, m) for m in seconds.values()],
                                      max_tokens=task.FINAL_MAX_TOKENS, temperature=temperature, seed=seed + 1),
                      strict=True)) if seconds else {}
    episodes = Episodes([TrainingGroup(f"{tag}-g{i}", "task", "demo") for i in range(len(requests))])
    for j, (i, k) in enumerate(rows):
        first, final = turns1[j], turns2.get(j)
        reward = task.episode_reward(requests[i], first.message, final.message if final else None,
                                     first_truncated=first.truncated,
                                     final_truncated=final.truncated if final else False)
        branch = [first.branch_turn(firsts[i])] + ([final.branch_turn(seconds[j])] if final else [])
        episodes.groups[i].members.append(GroupMember(f"{tag}-g{i}-t{k}", branch, reward))
        episodes.rewards.append(reward)
        episodes.right_tool.append(called[j] == requests[i].tool)
        episodes.well_formed.append(called[j] is not None)
    if without_replacement and inclusion_weights:
        for i, group in enumerate(episodes.groups):
            rows_of_group = range(i * group_size, (i + 1) * group_size)
            weighted = centred_rewards([episodes.rewards[j] for j in rows_of_group],
                                       [log_weights[j] for j in rows_of_group])
            for member, reward in zip(group.members, weighted, strict=True):
                member.reward = reward
    return episodes


# --------------------------------------------------------------------------- evaluation


def evaluate(model: Any, tokenizer: Any, held_out: list[task.Request], samples: int, seed: int) -> dict[str, Any]:
    """Right-tool and format rates of first turns on held-out requests: sampled at T=1, and greedy."""
    per_request = max(1, samples // len(held_out))
    prompts = [render(tokenizer, task.first_messages(r)) for r in held_out]
    sampled = sample(model, tokenizer, [p for p in prompts for _ in range(per_request)],
                     max_tokens=task.FIRST_TURN_MAX_TOKENS, temperature=1.0, seed=seed)
    greedy = sample(model, tokenizer, prompts, max_tokens=task.FIRST_TURN_MAX_TOKENS, temperature=0.0, seed=seed)
    right = [r.tool for r in held_out for _ in range(per_request)]
    called = [task.called_tool(t.message, truncated=t.truncated) for t in sampled]
    called_greedy = [task.called_tool(t.message, truncated=t.truncated) for t in greedy]
    hits = list(zip(called, right, strict=True))
    by_tool = {tool: mean([c == r for c, r in hits if r == tool]) for tool in task.TOOL_NAMES}
    return {"right_tool": mean([c == r for c, r in hits]), "by_tool": by_tool,
            "format": mean([c is not None for c in called]),
            "right_tool_greedy": mean([c == r.tool for c, r in zip(called_greedy, held_out, strict=True)]),
            "format_greedy": mean([c is not None for c in called_greedy]),
            "samples": len(sampled), "mean_tokens": mean([len(t.completion_ids) for t in sampled])}


def mean(values: list[Any]) -> float:
    return sum(float(v) for v in values) / len(values) if values else float("nan")


def load_policy(base: Path, adapter: Path | None) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


# --------------------------------------------------------------------------- a round as a fresh process


def child_round_seconds(base: Path, groups: list[TrainingGroup], grpo: dict[str, Any], work: Path, threads: int,
                        ) -> tuple[float, float]:
    """(wall, CPU) seconds of ``python -m flywheel.trainer.grpo`` on ``groups`` in a new process."""
    groups_file = work / "child-groups.jsonl"
    groups_file.write_text("".join(json.dumps(g.to_json()) + "\n" for g in groups))
    flags = [x for key, value in grpo.items() if key != "progress"
             for x in (f"--{key.replace('_', '-')}", ",".join(value) if isinstance(value, list) else str(value))]
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "flywheel.trainer.grpo", "--base", str(base), "--groups", str(groups_file),
                    "--out", str(work / "child-adapter"), "--tiny", *flags], check=True, cwd=ROOT,
                   capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads or "")})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.perf_counter() - started, cpu


def gateway_episode_cost(model: Path, episodes: int, work: Path, seed: int) -> dict[str, float]:
    """Serve ``model`` with a real gateway (local engine, capture on), run the demo agent against it.

    Returns the CPU seconds per episode of the gateway and its store process (psutil), and the
    episodes per wall second (which depends on what else the machine runs).
    """
    import asyncio

    import psutil

    from examples.demo.agent import Args as AgentArgs
    from examples.demo.agent import Summary, run_agent

    port = free_port()
    config = work / "gateway.toml"
    config.write_text(f'data_dir = "{work / "gateway-data"}"\nlog_level = "warning"\n'
                      f'[engines.local]\nmodel = "{model}"\n[aliases.demo]\nengine = "local"\n')
    url = f"http://127.0.0.1:{port}"
    with (work / "gateway.log").open("wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "flywheel.gateway", "serve", "--config", str(config), "--port",
                                   str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until_answering(url, server, timeout_s=300.0)
        except NotAnswering as exc:
            raise RuntimeError(f"the gateway did not start: {exc}: see {work / 'gateway.log'}") from exc
        processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]

        def cpu() -> float:
            return sum(p.cpu_times().user + p.cpu_times().system for p in processes)

        agent = AgentArgs(base_url=f"{url}/v1", episodes=8, seed=seed + 1, feedback=False)
        asyncio.run(run_agent(agent, Summary(), emit=lambda line: None))  # warm-up: first requests load lazily
        agent.episodes, agent.seed, agent.feedback = episodes, seed, True
        before, started = cpu(), time.perf_counter()
        summary = asyncio.run(run_agent(agent, Summary(), emit=lambda line: None))
        wall, spent = time.perf_counter() - started, cpu() - before
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"episodes": summary.episodes, "errors": summary.errors, "cpu_s_per_episode": spent / summary.episodes,
            "episodes_per_s": summary.episodes / wall, "reward": summary.reward, "right_tool": summary.right_tool}


# --------------------------------------------------------------------------- the loop


def main() -> None:
    args = parse_args()
    import torch
    from transformers import AutoTokenizer

    from flywheel.trainer import adapters
    from flywheel.trainer.grpo import train_round
    from flywheel.trainer.grpo_args import GRPOArgs
    from flywheel.trainer.tiny_model import ensure_tiny_model
    from flywheel.trainer.warm_start import warm_start

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    grpo = {**DEFAULT_GRPO, "temperature": args.temperature, "num_generations": args.group_size,
            "seed": args.seed, **json.loads(args.grpo)}
    grpo_args = GRPOArgs.tiny(**grpo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{args.tag or 'untagged'}-", dir=out))
    print(f"settings: {json.dumps(asdict(args))}\ngrpo: {json.dumps(asdict(grpo_args))}", flush=True)

    # 1. the tiny model and its format-only warm start (cached)
    tiny = ensure_tiny_model(out / "tiny", seed=args.seed)
    started = time.perf_counter()
    name = f"warm-{args.warm_start_steps}-{args.warm_start_batch}-{args.warm_start_lr:g}-{args.seed}"
    base = warm_start(tiny, out / name, task.warm_start_examples(args.warm_start_examples, seed=args.seed),
                      steps=args.warm_start_steps, batch_size=args.warm_start_batch,
                      learning_rate=args.warm_start_lr, seed=args.seed, progress=False)
    record = json.loads((base / "warm_start.json").read_text())
    print(f"warm start: {base} ({record['seconds']} s wall, {record['cpu_seconds']} s CPU when built, "
          f"loss {record['loss_last']:.4f}; "
          f"{time.perf_counter() - started:.1f} s now)")
    if args.measure_gateway:
        cost = gateway_episode_cost(base, args.measure_gateway, run_dir, args.seed)
        print(f"gateway: {json.dumps(cost)}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    pool = task.request_pool(args.pool, seed=args.seed)
    held_out = task.request_pool(args.eval_requests, seed=args.seed + 1, held_out=True)

    # 2. the baseline: the warm start itself
    policy = load_policy(base, None)
    baseline = evaluate(policy, tokenizer, held_out, args.eval_samples, seed=args.seed)
    curve: list[dict[str, Any]] = [{"round": 0, "clock_s": 0.0, **baseline}]
    print("round  clock_s  sample_s  train_s  steps  reward  ep_right  right_T1  right_greedy  format_T1  tokens  "
          + " ".join(task.TOOL_NAMES))
    print(f"{0:>5}  {0:>7.0f}  {'':>8}  {'':>7}  {'':>5}  {'':>6}  {'':>8}  {baseline['right_tool']:>8.3f}  "
          f"{baseline['right_tool_greedy']:>12.3f}  {baseline['format']:>9.3f}  {baseline['mean_tokens']:>6.1f}  "
          f"{' '.join(f'{v:.2f}' for v in baseline['by_tool'].values())}",
          flush=True)

    # 3. rounds: sample -> reward -> groups -> train (continuing) -> evaluate
    order = random.Random(args.seed)
    queue: list[task.Request] = []
    adapter: Path | None = None
    clock = 0.0
    for round_ in range(1, args.rounds + 1):
        if clock >= args.minutes * 60:
            break
        while len(queue) < args.groups_per_round:  # the agent cycles through its pool, reshuffled each pass
            queue += order.sample(pool, len(pool))
        requests, queue = queue[: args.groups_per_round], queue[args.groups_per_round:]
        cpu = time.process_time()
        episodes = run_episodes(policy, tokenizer, requests, group_size=args.group_size,
                                temperature=args.temperature, seed=args.seed * 1000 + round_, tag=f"r{round_}",
                                without_replacement=args.without_replacement,
                                inclusion_weights=args.inclusion_weights)
        sample_s, cpu = time.process_time() - cpu, time.process_time()
        result = train_round(base, episodes.groups, grpo_args, init_adapter=adapter, out_dir=run_dir / str(round_),
                             optimizer_state=adapters.optimizer_state_of(adapter))
        train_s = time.process_time() - cpu
        if args.measure_child and round_ == 1:
            child_wall, child_cpu = child_round_seconds(base, episodes.groups, grpo, run_dir, args.threads)
            print(f"round 1 as a fresh `python -m flywheel.trainer.grpo` process: {child_wall:.1f} s wall, "
                  f"{child_cpu:.1f} s "
                  f"CPU (in this process: {train_s:.1f} s CPU)", flush=True)
        clock += len(episodes.rewards) * args.episode_cost_s + train_s + args.round_overhead_s
        if result.status == "finished":
            adapter = result.adapter_dir
            policy = load_policy(base, adapter)
        rates = evaluate(policy, tokenizer, held_out, args.eval_samples, seed=args.seed + round_)
        point = {"round": round_, "clock_s": clock, "sample_s": sample_s, "train_s": train_s,
                 "steps": result.metrics.get("charts/steps", 0), "status": result.status,
                 "episode_reward": mean(episodes.rewards), "episode_right_tool": mean(episodes.right_tool),
                 "episode_format": mean(episodes.well_formed), "clipfrac": result.metrics.get("losses/clipfrac"),
                 "skipped": result.skipped, **rates}
        curve.append(point)
        print(f"{round_:>5}  {clock:>7.0f}  {sample_s:>8.1f}  {train_s:>7.1f}  {point['steps']:>5.0f}  "
              f"{point['episode_reward']:>6.3f}  {point['episode_right_tool']:>8.3f}  {rates['right_tool']:>8.3f}  "
              f"{rates['right_tool_greedy']:>12.3f}  {rates['format']:>9.3f}  {rates['mean_tokens']:>6.1f}  "
              f"{' '.join(f'{v:.2f}' for v in rates['by_tool'].values())}", flush=True)

    # 4. the curve against the loop clock
    summary = {"baseline": baseline["right_tool"]}
    for mark in MARKS_MIN:
        reached = [p for p in curve if p["clock_s"] <= mark * 60]
        summary[f"right_tool_at_{mark:g}min"] = reached[-1]["right_tool"]
    summary["best"] = max(p["right_tool"] for p in curve)
    summary["collapsed"] = any(p["format"] < COLLAPSED_FORMAT_RATE for p in curve[1:])
    print("summary: " + json.dumps(summary))
    if args.log:
        with open(args.log, "a") as log:
            log.write(json.dumps({"tag": args.tag, "args": asdict(args), "grpo": grpo, "warm_start": record,
                                  "curve": curve, "summary": summary}) + "\n")


if __name__ == "__main__":
    main()
