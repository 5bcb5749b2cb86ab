"""The tiny model: deterministic build, loads like a real Qwen2.5 directory, renders tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.trainer.tiny_model import TOOL_TOKENS, build_tiny_model, build_tokenizer, ensure_tiny_model
from tests.support import WEATHER_TOOLS, tiny_dir


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dir(tmp_path_factory.getbasetemp() / "flywheel-models")


@pytest.fixture(scope="session")
def tokenizer(tiny: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_gives_identical_files(tiny: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    first, second = _weights(tiny), _weights(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = _weights(build_tiny_model(tmp_path / "other", seed=1))
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_loads_back_like_a_qwen_directory(tiny: Path, tokenizer: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    assert 100_000 < params < 1_000_000
    assert model.config.tie_word_embeddings
    assert 1000 <= len(tokenizer) <= 2100 and model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id
    # Tool markers are single, NON-special tokens: they survive skip_special_tokens=True.
    for marker in TOOL_TOKENS:
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == marker
    ids = tokenizer("<|im_start|>assistant\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nhi"


def test_built_and_loaded_tokenizers_split_text_the_same(tokenizer: Any) -> None:
    # transformers 5 loads model_type qwen2 with Qwen2Tokenizer, which rebuilds the
    # pre-tokenizer; the builder trains with that same pre-tokenizer.
    built = build_tokenizer(seed=0)
    samples = ["Hello, world! It's 2024-05-01.", '{"city": "Paris", "n": 12345}',
               "  spaced\n\n\ttext  ", "héllo wörld ✓ 日本"]
    for text in samples:
        assert built(text, add_special_tokens=False)["input_ids"] == \
            tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_ensure_builds_only_when_missing(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    assert ensure_tiny_model(target) == target
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(target)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in target.parent.iterdir() if p.name != "tiny"]  # no staging leftovers


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs))


def test_chat_template_plain_conversation(tokenizer: Any) -> None:
    text = _render(tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    text = _render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_template_renders_tools_and_calls(tokenizer: Any) -> None:
    call_str = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    call_dict = {**call_str, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call_str]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = _render(tokenizer, messages, tools=WEATHER_TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER_TOOLS[0]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    expected_call = ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
                     '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n')
    assert expected_call in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Arguments as a dict render the same as the JSON string (never double-encoded).
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [call_dict]}
    assert _render(tokenizer, messages, tools=WEATHER_TOOLS) == text


def test_chat_template_content_and_several_calls(tokenizer: Any) -> None:
    calls = [{"type": "function", "function": {"name": "a", "arguments": {}}},
             {"type": "function", "function": {"name": "b", "arguments": {"x": 1}}}]
    text = _render(tokenizer, [{"role": "user", "content": [{"type": "text", "text": "go"}]},
                               {"role": "assistant", "content": "On it.", "tool_calls": calls},
                               {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert "<|im_start|>user\ngo<|im_end|>" in text
    assert ('On it.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call><|im_end|>') in text
    # Consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
            "</tool_response><|im_end|>") in text
