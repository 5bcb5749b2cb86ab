"""What the trainer reads: scored groups, each member one branch of a trajectory as turns.

This is the hand-off between capture (which knows the store) and the trainer (which
knows nothing of serving or storage): plain dataclasses that serialize to JSON, so a
trainer in another process gets the same thing through the admin API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BranchTurn:
    """One turn on a branch: the prompt the model saw and what it sampled."""

    request_messages: list[dict[str, Any]]
    response_message: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None  # exact ids from the engine; None when unknown or redacted
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None  # behaviour logprobs of completion_token_ids
    finish_reason: str | None = None
    turn_id: str | None = None
    params: dict[str, Any] | None = None  # the request's sampling parameters (turns.params); None: OpenAI's defaults
    inclusion_logprob: float | None = None  # drawn without replacement: log q (turns.inclusion_logprob)


@dataclass
class GroupMember:
    """One attempt in a group: a root-to-leaf branch of a trajectory and its reward."""

    trajectory_id: str
    turns: list[BranchTurn]
    reward: float
    leaf_turn_id: str | None = None


@dataclass
class TrainingGroup:
    """Attempts at the same task, compared with each other by GRPO."""

    group_id: str
    source: str  # explicit | task | fork | cohort | sdk
    alias: str
    members: list[GroupMember] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``asdict(self)`` without its deep copy of every token list: what this returns is serialized at once."""
        return {"group_id": self.group_id, "source": self.source, "alias": self.alias,
                "members": [{"trajectory_id": m.trajectory_id, "turns": [dict(vars(t)) for t in m.turns],
                             "reward": m.reward, "leaf_turn_id": m.leaf_turn_id} for m in self.members]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingGroup:
        members = [GroupMember(trajectory_id=m["trajectory_id"], reward=float(m["reward"]),
                               leaf_turn_id=m.get("leaf_turn_id"),
                               turns=[BranchTurn(**t) for t in m["turns"]]) for m in data["members"]]
        return cls(group_id=data["group_id"], source=data["source"], alias=data["alias"], members=members)
