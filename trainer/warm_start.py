"""A short supervised warm start: teach a random model a task's format (not the task) before RL.

    from flywheel.trainer.warm_start import warm_start
    from examples.demo.task import warm_start_examples
    model_dir = warm_start(tiny_dir, data_dir / "models" / "demo-warm", warm_start_examples(512, seed=0))

A random model never produces a well-formed tool call, so every group of its attempts has
the same reward (0) and GRPO has nothing to compare. A few hundred full-parameter AdamW
steps on whole conversations in the right format, with the tool chosen at random, make it
call *some* tool and then answer; RL then teaches *which* tool. This exists only because
the tiny demo model starts from random weights: a real instruct model needs none of it.

Examples are conversations (messages, tools); every assistant message is a target, trained
up to and including its end-of-turn token, in the tokens the engine will see: each turn's
prompt is the chat template's rendering, so the model learns what it is later asked to
continue. The result (model + tokenizer + ``warm_start.json``) is written to ``out_dir``
through a staging directory; a later call with the same examples and settings returns it at
once (``warm_start.json`` holds their fingerprint), other ones train again and replace it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # messages, tools
IGNORE = -100  # label of a token that is not trained (prompt, tool results)
RECORD_FILE = "warm_start.json"


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        ) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and their labels: each assistant turn's tokens, ``IGNORE`` elsewhere.

    Each assistant turn is what rendering it adds after the template's prompt for it, cut just
    after the end-of-turn token (the template's newline belongs to the next prompt).
    """
    ids: list[int] = []
    labels: list[int] = []
    done = ""  # text already encoded
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError(f"the chat template renders message {i}'s history differently once it is answered")
        answer = full[len(prompt):]
        answer = answer[: answer.index(tokenizer.eos_token) + len(tokenizer.eos_token)]
        context_ids = tokenizer(prompt[len(done):], add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        ids += context_ids + answer_ids
        labels += [IGNORE] * len(context_ids) + answer_ids
        done = prompt + answer
    return ids, labels


def _batch(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Any]:
    import torch

    width = max(len(ids) for ids, _ in encoded)
    # Right padding: the real tokens keep positions 0..n-1, as when the engine decodes them unpadded.
    return {
        "input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in encoded]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in encoded]),
        "labels": torch.tensor([labels + [IGNORE] * (width - len(labels)) for _, labels in encoded]),
    }


def warm_start(model_dir: str | Path, out_dir: str | Path, examples: Sequence[Conversation], *, steps: int = 80,
               batch_size: int = 16, learning_rate: float = 6e-3, seed: int = 0, progress: bool = True) -> Path:
    """Fine-tune all of ``model_dir`` on ``examples`` for ``steps`` AdamW steps; save it to ``out_dir``.

    Each step trains on ``batch_size`` examples drawn at random (seeded). Returns ``out_dir``
    at once when it already holds the warm start of these examples and settings.
    """
    out = Path(out_dir)
    settings = {"base_model": str(model_dir), "steps": steps, "batch_size": batch_size, "learning_rate": learning_rate,
                "seed": seed, "examples": len(examples)}
    fingerprint = hashlib.sha256(json.dumps([settings, list(examples)], sort_keys=True).encode()).hexdigest()
    if (out / RECORD_FILE).is_file() and json.loads((out / RECORD_FILE).read_text()).get("fingerprint") == fingerprint:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started, cpu_started = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encoded = [encode_conversation(tokenizer, messages, tools) for messages, tools in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    with _progress(progress, steps) as advance:
        for _ in range(steps):
            loss = model(**_batch(rng.sample(encoded, min(batch_size, len(encoded))), tokenizer.pad_token_id)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            advance(losses[-1])
    model.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {**settings, "fingerprint": fingerprint, "loss_first": losses[0] if losses else None,
                  "loss_last": losses[-1] if losses else None, "seconds": round(time.perf_counter() - started, 1),
                  "cpu_seconds": round(time.process_time() - cpu_started, 1)}
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if out.is_dir():  # empty, or a warm start from other examples or settings: replaced
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


@contextlib.contextmanager
def _progress(enabled: bool, steps: int) -> Iterator[Callable[[float], None]]:
    """A rich progress bar with the running loss (or nothing); call the yielded function once a step."""
    if not enabled:
        yield lambda loss: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("warm start"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("loss {task.fields[loss]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("warm start", total=steps, loss="-")
        yield lambda loss: bar.update(task, advance=1, loss=f"{loss:.3f}")
