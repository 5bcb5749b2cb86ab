"""Captured groups -> training samples: token ids, sampled-token masks, behaviour logprobs, advantages.

    from flywheel.trainer.samples import build_samples
    batch = build_samples(groups, tokenizer, max_prompt_tokens=4096, max_completion_tokens=2048)
    batch.samples[0].completion_ids, batch.samples[0].env_mask, batch.skip_counts()

Each member of a group (one root-to-leaf branch of a trajectory) becomes one sequence, or
several when its turns do not chain (below). A sequence is what TRL's ``rollout_func``
returns for one row:

- ``prompt_ids``: the first turn's prompt.
- ``completion_ids``: every later token: what the model sampled at each turn and, between
  turns, the tokens it did not sample (the chat template's turn markers, tool results, the
  user's next message).
- ``env_mask``: 1 exactly on the tokens the model sampled, 0 on the tokens in between.
- ``logprobs``: the behaviour log-probability of each sampled token when the engine
  reported it, ``None`` on env tokens and wherever it is unknown.

**Exact ids or the chat template.** A turn captured with the engine's own token ids
(``prompt_token_ids`` / ``completion_token_ids``) is used as is: those are the tokens the
model conditioned on and sampled. A turn without them is rendered with the tokenizer's chat
template: the prompt is ``apply_chat_template(messages, add_generation_prompt=True)``, the
completion is what rendering ``messages + [response]`` adds after it, cut just after the eos
token (``<|im_end|>``; the template's trailing newline belongs to the next prompt), or just
before it when the turn was cut short — ``finish_reason`` ``length`` (the token limit) or
``client_disconnected`` (the client left mid-stream) — since the model never sampled it.
Such sequences are flagged ``retokenized``: the text is right, the token boundaries may
differ from what was sampled, and there are no behaviour logprobs.

**Sampling parameters.** A captured logprob is the behaviour policy's only when the turn was
drawn from what the trainer computes, ``softmax(logits / temperature)``: at the trainer's
temperature, with ``top_p`` 1, no ``top_k`` / ``min_p``, no penalties, no logit bias, no
constrained decoding (``offpolicy_params``; parameters the client did not send are OpenAI's
defaults: temperature 1, top_p 1). A turn sampled otherwise keeps its tokens but loses its
behaviour logprobs (the trainer then uses the policy's own at the start of the step: ratio 1),
and its sequences are flagged ``offpolicy_params`` and counted (docs/trainer.md explains why
they are not re-weighted).

**Concatenation rule (append-only, checked on tokens).** Turn *t+1* is appended to the
sequence when its prompt ids start with the sequence's prompt + completion so far; the
extra prompt tokens become env tokens (mask 0), then its completion follows (mask 1).
Otherwise (the client rewrote history, the engine re-tokenized the earlier answer
differently, the template drops earlier reasoning) the member is split: a new sequence
starts with turn *t+1*'s full prompt. Every sequence of a member keeps the member's reward
and advantage. A sequence is also split when appending the next turn would pass
``max_completion_tokens``.

**Length limits and truncation.** ``max_prompt_tokens`` bounds a sequence's prompt,
``max_completion_tokens`` its completion (sampled + env tokens). ``truncation="left"``
cuts an over-long prompt from the left (the most recent context is kept) and an over-long
single-turn completion from the right (what the model sampled first is kept); such
sequences are flagged ``truncated``, and a left-cut prompt drops the sequence's behaviour
logprobs (they were conditioned on the full context). ``truncation="drop"`` skips a member
with a sequence that does not fit instead.

**Advantages** follow GRPO (and TRL's code, constant included):
``A_i = (r_i - mean(r_group)) / (std + 1e-4)`` with the unbiased std of the group
(``advantage_scale="group"``) or of every kept member of the batch (``"batch"``), or
``r_i - mean(r_group)`` (``"none"``). They are computed over a group's members, not its
sequences. A group whose rewards are all equal carries no signal: it is skipped and
counted (``zero_variance``), as are groups with fewer than ``min_group_size`` members left
(``too_small``) and members that could not be turned into a sequence (``template_mismatch``,
``empty``, ``too_long``). ``SampleBatch.skip_counts()`` sums them up by reason.

**Members drawn without replacement** (a forked turn's siblings with ``[groups] fork_draw``; their
turn records ``inclusion_logprob``, log q) are not independent samples, so the group's mean is not
their baseline. Each gets the self-normalized weight ``w_i = (p_i / q_i) / sum_j (p_j / q_j)`` over
the drawn members (p from its sampled logprobs), the baseline is ``B = sum_j w_j r_j``, and a drawn
member's centred reward is ``k w_i (r_i - B)`` (k drawn members: equal weights give back ``r_i - B``);
an independent member in the same group (the client's answer) gets ``r_i - B``, a baseline made of
other samples. Stochastic beam search, Kool, van Hoof & Welling 2019, section 4. The ``group`` scale
then divides by the std of the centred rewards (the std of the rewards, for a group drawn
independently). TRL cannot see such weights: these groups are not compared with its advantages.

Nothing here imports torch: the module is pure Python over token id lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from flywheel.capture.batches import BranchTurn, GroupMember, TrainingGroup

Truncation = Literal["left", "drop"]
AdvantageScale = Literal["group", "batch", "none"]
# Parameters that reshape the distribution a token is drawn from, and their values that leave it alone (OpenAI's and
# vLLM's defaults; absent, None, {} and [] leave it alone too). vLLM decodes response_format and tool_choice
# "required" / a named function under a grammar.
NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
    "repetition_penalty": (1,), "logit_bias": (), "min_tokens": (0,), "bad_words": (), "allowed_token_ids": (),
    "response_format": ({"type": "text"},), "tool_choice": ("auto", "none"), "structured_outputs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}
ADVANTAGE_EPS = 1e-4  # TRL adds the same constant to the std (grpo_trainer.py, "advantages / (std + 1e-4)")
ZERO_VARIANCE_TOL = 1e-6  # rewards closer than this count as equal


@dataclass
class Sample:
    """One training sequence: a member's turns (or a run of them), ready for TRL's ``rollout_func``."""

    group_id: str
    trajectory_id: str
    member_index: int  # position of the member in its (captured) group
    part: int  # 0 for the first sequence of a member; 1, 2, ... when its turns were split
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]  # 1 on sampled tokens, 0 on template / tool / user tokens between turns
    logprobs: list[float | None] | None  # behaviour logprob per completion token; None where unknown or not sampled
    reward: float
    advantage: float = 0.0
    retokenized: bool = False  # some turn was rendered with the chat template (no exact ids)
    truncated: bool = False  # prompt cut from the left or completion cut from the right
    turns: int = 1  # turns concatenated into this sequence
    offpolicy_params: bool = False  # some turn sampled with other parameters than the trainer's: its logprobs dropped

    @property
    def sampled_tokens(self) -> int:
        return sum(self.env_mask)


@dataclass
class Skipped:
    """Something that was not turned into samples, and why."""

    group_id: str
    reason: str  # zero_variance | too_small | template_mismatch | empty | too_long
    members: int  # members (attempts) affected
    trajectory_id: str | None = None  # set when one member was skipped, None for a whole group


@dataclass
class SampleBatch:
    """The samples of a training round plus the record of what was left out."""

    samples: list[Sample]
    group_ids: list[str]  # groups that produced samples, in input order
    skipped: list[Skipped]
    advantage_scale: str
    groups_in: int
    members_in: int
    sources: dict[str, str] = field(default_factory=dict)  # group_id -> source (explicit, task, fork, ...)
    weighted: set[str] = field(default_factory=set)  # groups with members drawn without replacement

    def skip_counts(self) -> dict[str, dict[str, int]]:
        """``{reason: {"groups": n, "members": m}}``; ``groups`` counts whole groups skipped."""
        counts: dict[str, dict[str, int]] = {}
        for skip in self.skipped:
            entry = counts.setdefault(skip.reason, {"groups": 0, "members": 0})
            entry["members"] += skip.members
            if skip.trajectory_id is None:
                entry["groups"] += 1
        return counts

    def stats(self) -> dict[str, float]:
        """Flat, namespaced numbers about the batch (``samples/...``, ``reward/...``, ``advantage/...``)."""
        out: dict[str, float] = {
            "samples/groups_in": self.groups_in,
            "samples/members_in": self.members_in,
            "samples/groups": len(self.group_ids),
            "samples/groups_weighted": len(self.weighted),  # with members drawn without replacement
            "samples/sequences": len(self.samples),
            "samples/retokenized": sum(s.retokenized for s in self.samples),
            "samples/split": sum(s.part > 0 for s in self.samples),
            "samples/truncated": sum(s.truncated for s in self.samples),
            "samples/offpolicy_params_sequences": sum(s.offpolicy_params for s in self.samples),
            "samples/sampled_tokens": sum(s.sampled_tokens for s in self.samples),
            "samples/tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in self.samples),
        }
        for reason, entry in sorted(self.skip_counts().items()):
            out[f"samples/skipped_groups/{reason}"] = entry["groups"]
            out[f"samples/skipped_members/{reason}"] = entry["members"]
        # Rewards and advantages per member (a split member counts once).
        members = {(s.group_id, s.member_index): s for s in self.samples}
        rewards = [s.reward for s in members.values()]
        advantages = [s.advantage for s in members.values()]
        if rewards:
            out["reward/mean"] = _mean(rewards)
            out["reward/std"] = _std(rewards)
            by_group: dict[str, list[float]] = {}
            for s in members.values():
                by_group.setdefault(s.group_id, []).append(s.reward)
            out["reward/std_in_group"] = _mean([_std(r) for r in by_group.values()])
            out["advantage/mean"] = _mean(advantages)
            out["advantage/std"] = _std(advantages)
            out["advantage/min"] = min(advantages)
            out["advantage/max"] = max(advantages)
            out["advantage/abs_mean"] = _mean([abs(a) for a in advantages])
        return out


# --------------------------------------------------------------------------- advantages (reference math)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    """Unbiased (n - 1) standard deviation, as ``torch.std`` and TRL's ``nanstd``; 0 for one value."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def is_zero_variance(rewards: list[float]) -> bool:
    return max(rewards) - min(rewards) < ZERO_VARIANCE_TOL


def drawn_log_weight(member: GroupMember) -> float | None:
    """log(p / q) of a member drawn without replacement (its last turn, the drawn one); None for one drawn
    independently, or whose sampled logprobs are unknown."""
    turn = member.turns[-1] if member.turns else None
    if turn is None or turn.inclusion_logprob is None or not turn.completion_logprobs \
            or any(lp is None for lp in turn.completion_logprobs):
        return None
    return sum(turn.completion_logprobs) - turn.inclusion_logprob


def centred_rewards(rewards: list[float], log_weights: list[float | None] | None = None) -> list[float]:
    """``r - baseline`` for each member: the group's mean, or, with two or more members drawn without
    replacement (``log_weights[i]`` = log(p_i / q_i); None: drawn independently), the weighted baseline
    and ``k w_i (r_i - B)`` for the drawn ones (module docstring)."""
    drawn = [i for i, lw in enumerate(log_weights or []) if lw is not None]
    if len(drawn) < 2:
        baseline = _mean(rewards)
        return [r - baseline for r in rewards]
    assert log_weights is not None
    top = max(float(log_weights[i] or 0.0) for i in drawn)
    unnormalized = {i: math.exp(float(log_weights[i] or 0.0) - top) for i in drawn}
    w = {i: x / sum(unnormalized.values()) for i, x in unnormalized.items()}
    baseline = sum(w[i] * rewards[i] for i in drawn)
    return [len(drawn) * w[i] * (r - baseline) if i in w else r - baseline for i, r in enumerate(rewards)]


def group_advantages(group_rewards: list[list[float]], scale: AdvantageScale = "group",
                     group_log_weights: list[list[float | None]] | None = None) -> list[list[float]]:
    """GRPO's group-relative advantages, one list per group: the reference TRL's numbers are tested against.

    1. baseline: the mean reward of the group (members drawn without replacement: ``centred_rewards``);
    2. scale: the std of the group's centred rewards (``group``), the std of all rewards given (``batch``),
       or none;
    3. ``A = (r - baseline) / (std + 1e-4)`` (or ``r - baseline`` for ``none``).
    """
    assert scale in ("group", "batch", "none"), scale
    batch_std = _std([r for rewards in group_rewards for r in rewards])
    out = []
    for g, rewards in enumerate(group_rewards):
        centred = centred_rewards(rewards, group_log_weights[g] if group_log_weights else None)
        if scale == "none":
            out.append(centred)
            continue
        std = _std(centred) if scale == "group" else batch_std
        out.append([c / (std + ADVANTAGE_EPS) for c in centred])
    return out


# --------------------------------------------------------------------------- turns -> token ids


class _SkipMember(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _TurnTokens:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float | None] | None
    retokenized: bool
    offpolicy_params: bool  # sampled with other parameters than the trainer's: logprobs dropped


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
            generation_prompt: bool) -> str:
    # transformers 5: tokenize=True returns a BatchEncoding; render text and encode it ourselves.
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                         tokenize=False)
    return str(text)


UNFINISHED = ("length", "client_disconnected")  # finish reasons of turns that never sampled their end of turn


def _rendered_completion(tokenizer: Any, turn: BranchTurn, prompt_text: str) -> str:
    """The text the model sampled at ``turn``, as the chat template writes it (see module docstring)."""
    full = _render(tokenizer, [*turn.request_messages, turn.response_message], turn.tools, generation_prompt=False)
    if not full.startswith(prompt_text):
        raise _SkipMember("template_mismatch")  # the template renders history differently once answered
    completion = full[len(prompt_text):]
    eos = tokenizer.eos_token
    end = completion.rfind(eos) if eos else -1
    if end < 0:
        return completion
    if turn.finish_reason in UNFINISHED:
        return completion[:end]  # cut short (token limit, client gone): the eos was added by the template, not sampled
    return completion[:end + len(eos)]


def offpolicy_params(params: dict[str, Any] | None, temperature: float) -> list[str]:
    """The sampling parameters of a turn that make its distribution differ from the trainer's softmax(logits / T)."""
    params = params or {}
    sampled_at = params.get("temperature")
    differ = [] if math.isclose(1.0 if sampled_at is None else float(sampled_at), temperature) else ["temperature"]
    return differ + [name for name, neutral in NEUTRAL_SAMPLING.items()
                     if params.get(name) not in (None, {}, [], *neutral)]


def turn_tokens(tokenizer: Any, turn: BranchTurn, *, temperature: float = 1.0) -> _TurnTokens:
    """Prompt and completion ids of one turn: the engine's exact ids when captured, else rendered.

    Its behaviour logprobs are kept when it was sampled at ``temperature`` (the trainer's) with neutral parameters.
    """
    prompt_text: str | None = None
    if turn.prompt_token_ids is not None:
        prompt = list(turn.prompt_token_ids)
    else:
        prompt_text = _render(tokenizer, turn.request_messages, turn.tools, generation_prompt=True)
        prompt = _encode(tokenizer, prompt_text)
    if turn.completion_token_ids is not None:
        completion = list(turn.completion_token_ids)
        logprobs: list[float | None] | None = None
        if turn.completion_logprobs is not None and len(turn.completion_logprobs) == len(completion):
            logprobs = [None if lp is None else float(lp) for lp in turn.completion_logprobs]
    else:
        if prompt_text is None:
            prompt_text = _render(tokenizer, turn.request_messages, turn.tools, generation_prompt=True)
        completion = _encode(tokenizer, _rendered_completion(tokenizer, turn, prompt_text))
        logprobs = None  # no behaviour logprobs for tokens we made up
    retokenized = turn.prompt_token_ids is None or turn.completion_token_ids is None
    offpolicy = bool(offpolicy_params(turn.params, temperature))
    if offpolicy:
        logprobs = None  # of another distribution than the one the trainer's ratio divides by
    return _TurnTokens(prompt, completion, logprobs, retokenized, offpolicy)


# --------------------------------------------------------------------------- member -> sequences


@dataclass
class _Seq:
    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    retokenized: bool = False
    truncated: bool = False
    turns: int = 0
    offpolicy_params: bool = False

    def add(self, env: list[int], turn: _TurnTokens) -> None:
        self.completion += env + turn.completion
        self.env_mask += [0] * len(env) + [1] * len(turn.completion)
        self.logprobs += [None] * len(env) + (turn.logprobs or [None] * len(turn.completion))
        self.retokenized |= turn.retokenized
        self.offpolicy_params |= turn.offpolicy_params
        self.turns += 1


def member_sequences(tokenizer: Any, member: GroupMember, *, max_prompt_tokens: int, max_completion_tokens: int,
                     truncation: Truncation = "left", temperature: float = 1.0) -> list[_Seq]:
    """Chain a member's turns into sequences (append-only on tokens), then apply the length limits."""
    seqs: list[_Seq] = []
    for turn in member.turns:
        tokens = turn_tokens(tokenizer, turn, temperature=temperature)
        if seqs:
            current = seqs[-1]
            so_far = current.prompt + current.completion
            appendable = tokens.prompt[:len(so_far)] == so_far
            env = tokens.prompt[len(so_far):]
            if appendable and len(current.completion) + len(env) + len(tokens.completion) <= max_completion_tokens:
                current.add(env, tokens)
                continue
        seq = _Seq(prompt=tokens.prompt)
        seq.add([], tokens)
        seqs.append(seq)
    for seq in seqs:
        if len(seq.prompt) > max_prompt_tokens:
            if truncation == "drop":
                raise _SkipMember("too_long")
            seq.prompt = seq.prompt[len(seq.prompt) - max_prompt_tokens:]
            seq.logprobs = [None] * len(seq.completion)  # captured under the full context: no longer comparable
            seq.truncated = True
        if len(seq.completion) > max_completion_tokens:
            if truncation == "drop":
                raise _SkipMember("too_long")
            seq.completion = seq.completion[:max_completion_tokens]
            seq.env_mask = seq.env_mask[:max_completion_tokens]
            seq.logprobs = seq.logprobs[:max_completion_tokens]
            seq.truncated = True
    if not seqs or not any(sum(seq.env_mask) for seq in seqs):
        raise _SkipMember("empty")
    return [seq for seq in seqs if sum(seq.env_mask)]


# --------------------------------------------------------------------------- groups -> batch


def build_samples(groups: list[TrainingGroup], tokenizer: Any, *, max_prompt_tokens: int,
                  max_completion_tokens: int, truncation: Truncation = "left",
                  advantage_scale: AdvantageScale = "group", min_group_size: int = 2,
                  temperature: float = 1.0) -> SampleBatch:
    """Turn scored groups into training sequences with masks, behaviour logprobs and advantages.

    ``temperature`` is the trainer's (``GRPOArgs.temperature``): behaviour logprobs of turns sampled
    otherwise are dropped (``offpolicy_params``).

    Steps: (1) skip groups whose rewards are all equal; (2) tokenize each member, skipping
    members that cannot be; (3) skip groups left with fewer than ``min_group_size`` members
    or, after member losses, equal rewards; (4) group-normalize the rewards of what is left.
    """
    assert truncation in ("left", "drop"), truncation
    assert max_prompt_tokens > 0 and max_completion_tokens > 0
    skipped: list[Skipped] = []
    kept: list[tuple[TrainingGroup, list[tuple[int, GroupMember, list[_Seq]]]]] = []
    for group in groups:
        rewards = [m.reward for m in group.members]
        if len(rewards) < min_group_size:
            skipped.append(Skipped(group.group_id, "too_small", len(rewards)))
            continue
        if is_zero_variance(rewards):
            skipped.append(Skipped(group.group_id, "zero_variance", len(rewards)))
            continue
        members = []
        for index, member in enumerate(group.members):
            try:
                seqs = member_sequences(tokenizer, member, max_prompt_tokens=max_prompt_tokens,
                                        max_completion_tokens=max_completion_tokens, truncation=truncation,
                                        temperature=temperature)
            except _SkipMember as skip:
                skipped.append(Skipped(group.group_id, skip.reason, 1, member.trajectory_id))
                continue
            members.append((index, member, seqs))
        if len(members) < min_group_size:
            skipped.append(Skipped(group.group_id, "too_small", len(members)))
            continue
        if is_zero_variance([m.reward for _, m, _ in members]):
            skipped.append(Skipped(group.group_id, "zero_variance", len(members)))
            continue
        kept.append((group, members))

    log_weights = [[drawn_log_weight(m) for _, m, _ in members] for _, members in kept]
    advantages = group_advantages([[m.reward for _, m, _ in members] for _, members in kept], advantage_scale,
                                  log_weights)
    samples = []
    for (group, members), group_adv in zip(kept, advantages, strict=True):
        for (index, member, seqs), advantage in zip(members, group_adv, strict=True):
            for part, seq in enumerate(seqs):
                known = any(lp is not None for lp in seq.logprobs)
                samples.append(Sample(
                    group_id=group.group_id, trajectory_id=member.trajectory_id, member_index=index, part=part,
                    prompt_ids=seq.prompt, completion_ids=seq.completion, env_mask=seq.env_mask,
                    logprobs=seq.logprobs if known else None, reward=float(member.reward), advantage=advantage,
                    retokenized=seq.retokenized, truncated=seq.truncated, turns=seq.turns,
                    offpolicy_params=seq.offpolicy_params))
    return SampleBatch(samples=samples, group_ids=[g.group_id for g, _ in kept], skipped=skipped,
                       advantage_scale=advantage_scale, groups_in=len(groups),
                       members_in=sum(len(g.members) for g in groups),
                       sources={g.group_id: g.source for g, _ in kept},
                       weighted={g.group_id for (g, _), lws in zip(kept, log_weights, strict=True)
                                 if sum(lw is not None for lw in lws) >= 2})

