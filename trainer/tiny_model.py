"""The tiny model: a random Qwen2 with a small byte-level BPE tokenizer, built offline.

It stands in for a real Qwen2.5-Instruct checkpoint wherever no weights can be downloaded
(tests, first run of ``flywheel serve``). The directory it writes has the same layout and
loads through the same calls (``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``),
with a ChatML chat template that renders tools and Hermes-style ``<tool_call>`` blocks the
way Qwen2.5 does. Everything derives from ``seed``: same seed, byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = PAD_TOKEN  # Qwen2.5 uses <|endoftext|> as bos in its config but never prepends it
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of every turn: the eos token generation stops on
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Added as NON-special tokens: TRL decodes completions with skip_special_tokens=True, which
# would silently delete special markers and break tool-call parsing of training samples.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

VOCAB_SIZE = 1536
DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to help with the user query.\n\n"
    "The function signatures are listed within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, answer with a JSON object holding the function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# ChatML, Qwen2.5 style. Written for this project; the rendered text follows Qwen2.5's
# conventions so data captured against the tiny model looks like data from a real one.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system_text = text(messages[0].content) -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_text = " + json.dumps(DEFAULT_SYSTEM) + " -%}{%- set rest = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system_text -}}"
    "{%- if tools -%}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + json.dumps(TOOLS_INSTRUCTIONS) + " -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message.role == 'tool' -%}"
    # Consecutive tool results share one user turn, as in Qwen2.5.
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = text(message.content) -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    # Arguments arrive as a dict or (OpenAI wire format) a JSON string: never encode twice.
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = [
    "the", "a", "an", "of", "to", "and", "in", "is", "it", "you", "that", "he", "she", "was", "for",
    "on", "are", "with", "as", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up",
    "use", "your", "how", "said", "each", "which", "do", "their", "time", "if", "will", "way", "about",
    "many", "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing",
    "see", "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound",
    "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down",
    "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place", "made", "live",
    "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every", "good",
    "me", "give", "our", "under", "name", "very", "through", "just", "form", "sentence", "great",
    "think", "say", "help", "low", "line", "differ", "turn", "cause", "much", "mean", "before", "move",
    "right", "boy", "old", "too", "same", "tell", "does", "set", "three", "want", "air", "well", "also",
    "play", "small", "end", "put", "home", "read", "hand", "port", "large", "spell", "add", "even",
    "land", "here", "must", "big", "high", "such", "follow", "act", "why", "ask", "men", "change",
    "went", "light", "kind", "off", "need", "house", "picture", "try", "us", "again", "animal", "point",
    "mother", "world", "near", "build", "self", "earth", "father", "weather", "city", "today",
    "tomorrow", "rain", "sunny", "cloudy", "wind", "temperature", "degrees", "hello", "thanks", "please",
    "sure", "answer", "question", "yes", "search", "forecast", "email", "message", "send", "calendar",
    "meeting", "order", "price", "stock", "result", "file", "data",
]
_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Delhi"]
_TOOLS = {
    "get_weather": {"city": _CITIES},
    "search": {"query": ["weather today", "cheap flights", "python json", "news"]},
    "send_email": {"to": ["bob@example.com", "ann@example.com"], "subject": ["hi", "report"]},
    "get_time": {"timezone": ["UTC", "Europe/Paris", "Asia/Tokyo"]},
}


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", "?", "!"])


def _call(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(sorted(_TOOLS))
    args = {key: rng.choice(values) for key, values in _TOOLS[name].items()}
    return {"name": name, "arguments": args}


def _tool_schema(name: str) -> dict[str, Any]:
    props = {key: {"type": "string"} for key in _TOOLS[name]}
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                             "parameters": {"type": "object", "properties": props}}}


def _chat_text(rng: random.Random) -> str:
    # Hand-built ChatML text in the template's format (cheaper than rendering Jinja here).
    system = DEFAULT_SYSTEM
    call = _call(rng)
    if rng.random() < 0.5:
        system += TOOLS_PREAMBLE + "\n" + json.dumps(_tool_schema(call["name"])) + TOOLS_INSTRUCTIONS
    turns = [f"{IM_START}system\n{system}{IM_END}\n", f"{IM_START}user\n{_sentence(rng)}{IM_END}\n"]
    if rng.random() < 0.5:
        turns.append(f"{IM_START}assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call>{IM_END}\n")
        turns.append(f"{IM_START}user\n<tool_response>\n{json.dumps({'result': _sentence(rng)})}"
                     f"\n</tool_response>{IM_END}\n")
    turns.append(f"{IM_START}assistant\n{_sentence(rng)} {_sentence(rng)}{IM_END}\n")
    return "".join(turns)


def _json_snippet(rng: random.Random) -> str:
    value: dict[str, Any] = {rng.choice(_WORDS): rng.choice([rng.randint(0, 999), rng.choice(_WORDS),
                                                             rng.random() < 0.5, None])
                             for _ in range(rng.randint(1, 4))}
    return json.dumps(value, indent=rng.choice([None, 2]))


def training_corpus(seed: int = 0, size: int = 1500) -> list[str]:
    """Deterministic text the tokenizer is trained on: prose, JSON, chat and tool-call turns."""
    rng = random.Random(seed)
    makers = [_sentence, _json_snippet, _chat_text]
    corpus = [rng.choice(makers)(rng) for _ in range(size)]
    corpus.extend(str(i) for i in range(200))
    return corpus


def build_tokenizer(seed: int = 0) -> Any:
    """Train the byte-level BPE and wrap it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # transformers 5 loads every model_type "qwen2" directory with Qwen2Tokenizer, whatever
    # tokenizer_config.json says, and that class rebuilds the normalizer and pre-tokenizer
    # (NFC + Qwen's split regex + ByteLevel) from vocab and merges. Train with exactly those,
    # so the tokenizer built here and the one loaded back split text the same way.
    reference = Qwen2Tokenizer().backend_tokenizer
    backend.normalizer = reference.normalizer
    backend.pre_tokenizer = reference.pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(training_corpus(seed), trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD_TOKEN,
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   padding_side="left", model_max_length=2048)


def build_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny model + tokenizer deterministically from ``seed`` into ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=2048,
        tie_word_embeddings=True,
        # 0.02 (the default) leaves logits near-uniform and LoRA unable to move them (docs/engineering-notes.md).
        initializer_range=0.1,
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id, do_sample=True, temperature=1.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """Return ``path``, building the tiny model there first if it holds no ``config.json``."""
    out = Path(path)
    if (out / "config.json").is_file():
        return out
    # Build beside the target and rename, so an interrupted first run never leaves a
    # directory that has config.json but no weights or tokenizer.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build_tiny_model(staging, seed=seed)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
