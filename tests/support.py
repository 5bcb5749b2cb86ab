"""Shared test helpers: build the tiny model and teach it fixed answers in seconds.

``memorize`` fine-tunes the random tiny model until greedy decoding reproduces each
example's assistant text exactly, so tests can assert on real generated output (tool
calls, adapter-vs-base differences) instead of random tokens. Builders are idempotent:
calling one again with the same output directory reuses what is already there, which lets
session fixtures in different test modules share one build.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]
Example = tuple[Messages, str]

WEATHER_TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
WEATHER_MESSAGES: Messages = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER_CALL_TEXT = f"<tool_call>\n{json.dumps(WEATHER_CALL)}\n</tool_call>"
GREETING_MESSAGES: Messages = [{"role": "user", "content": "Say hello."}]
ADAPTER_TEXT = "Bonjour from the adapter."

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_tiny(path: Path) -> Path:
    """The tiny model in ``path`` (built once)."""
    from flywheel.trainer.tiny_model import ensure_tiny_model

    return ensure_tiny_model(path)


def _encode_examples(tokenizer: Any, examples: list[Example], tools: list[dict[str, Any]] | None,
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and labels (-100 on the prompt) for each example; targets end with <|im_end|>."""
    inputs, labels = [], []
    for messages, answer in examples:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        inputs.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    return inputs, labels


def _batch(inputs: list[list[int]], labels: list[list[int]], pad_id: int) -> dict[str, Any]:
    import torch

    width = max(len(x) for x in inputs)
    # Right padding: positions of the real tokens stay 0..len-1, as in unpadded decoding.
    return {
        "input_ids": torch.tensor([x + [pad_id] * (width - len(x)) for x in inputs]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in inputs]),
        "labels": torch.tensor([y + [-100] * (width - len(y)) for y in labels]),
    }


def _margin(model: Any, batch: dict[str, Any]) -> float:
    """Smallest (target logit - best other logit) over all answer tokens, teacher-forced.

    Positive everywhere means greedy decoding reproduces every answer exactly, because
    greedy decoding walks the same prefixes; a margin > 0 absorbs KV-cache rounding.
    """
    import torch

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    safe = targets.clamp(min=0)
    target_logit = logits.gather(-1, safe[..., None]).squeeze(-1)
    others = logits.scatter(-1, safe[..., None], float("-inf")).max(dim=-1).values
    return float((target_logit - others)[mask].min())


def memorize(model_dir: Path | str, out_dir: Path | str, examples: list[Example], *,
             tools: list[dict[str, Any]] | None = None, steps: int = 400, lora: bool = False,
             seed: int = 0, margin: float = 1.0) -> Path:
    """Fine-tune ``model_dir`` until greedy decoding answers each example's messages with its text.

    Full-parameter AdamW (lr 3e-3) by default, saving model + tokenizer to ``out_dir``; with
    ``lora=True`` a LoRA (r 16 on every linear layer except lm_head, lr 1e-2) saved as a
    PEFT adapter directory. Training stops once every answer token wins by ``margin``
    logits (checked every 10 steps); raises if ``steps`` are not enough. Reuses ``out_dir``
    when it already holds a result.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / ("adapter_config.json" if lora else "config.json")).is_file():
        return out
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():  # peft 0.21 calls a deprecated transformers-5 alias
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                     target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    batch = _batch(*_encode_examples(tokenizer, examples, tools), pad_id=tokenizer.pad_token_id)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2 if lora else 3e-3, weight_decay=0.0)
    model.train()
    for step in range(1, steps + 1):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 and _margin(model.eval(), batch) > margin:
            break
        model.train()
    else:
        raise AssertionError(f"memorize: answers not learned in {steps} steps (loss {loss.item():.3f})")
    model.eval()
    model.save_pretrained(out)
    if not lora:
        tokenizer.save_pretrained(out)
    return out


def greedy_answer(model_dir: Path | str, messages: Messages, *, tools: list[dict[str, Any]] | None = None,
                  adapter: Path | str | None = None, max_new_tokens: int = 64) -> str:
    """Greedy decode with plain transformers ``generate``: an oracle independent of our engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def tiny_dir(root: Path) -> Path:
    """The tiny model where ``LocalEngine(LocalEngineConfig(), data_dir=root)`` looks for it."""
    return build_tiny(root / "models" / "tiny")


def tool_model(root: Path) -> Path:
    """Tiny model fine-tuned to answer WEATHER_MESSAGES (with WEATHER_TOOLS) by calling
    get_weather(city="Paris") in Hermes format."""
    return memorize(tiny_dir(root), root / "tool-model", [(WEATHER_MESSAGES, WEATHER_CALL_TEXT)],
                    tools=WEATHER_TOOLS)


def greeting_adapter(root: Path) -> Path:
    """A LoRA on the tiny model that answers GREETING_MESSAGES with ADAPTER_TEXT."""
    return memorize(tiny_dir(root), root / "greeting-lora", [(GREETING_MESSAGES, ADAPTER_TEXT)], lora=True)


def warm_start(model_dir: Path | str, out_dir: Path | str, messages: Messages, answers: list[str], *,
               steps: int = 60, seed: int = 0) -> Path:
    """A short supervised warm start: for one prompt, each of ``answers`` becomes about equally likely.

    A random model almost never produces a particular answer, so a reward for one of them
    would give groups with no variance; after this the first token picks among ``answers``
    and RL has something to choose between. Full-parameter AdamW (lr 3e-3), saved with its
    tokenizer to ``out_dir`` (reused when already there).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = _batch(*_encode_examples(tokenizer, [(messages, a) for a in answers], None),
                   pad_id=tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# What the loop tests train with: quick steps on the tiny model (lora_r, lora_alpha, seed: GRPOArgs' defaults)
TINY_TRAIN_ARGS = """[train.args]
learning_rate = 5e-3
lora_r = 16
lora_alpha = 32
precision = "fp32"
gradient_accumulation_steps = 1
max_prompt_tokens = 256
max_completion_tokens = 16
seed = 0
"""


def tiny_loop_config(model: Path | str, tables: str) -> str:
    """A gateway's TOML: ``model`` on the local engine as alias ``agent`` (8 tokens a reply), trained with
    TINY_TRAIN_ARGS; ``tables`` are the test's own."""
    return (f'[engines.local]\nmodel = {json.dumps(str(model))}\ndefault_max_tokens = 8\n'
            f'[aliases.agent]\nengine = "local"\n{TINY_TRAIN_ARGS}{tables}')
