"""ART's trajectory types: what a rollout returns and what training compares.

    trajectory = flywheel.Trajectory(messages_and_choices=[{"role": "user", "content": "..."}], reward=0)
    completion = await client.chat.completions.create(model=model.name, messages=trajectory.messages())
    trajectory.messages_and_choices.append(completion.choices[0])        # a Choice: the model's own answer
    group = await flywheel.TrajectoryGroup(rollout(model, scenario) for _ in range(8))

``messages_and_choices`` holds plain message dicts (what the model was shown) and the ``Choice``
objects the ``openai`` client returned (what the model sampled: the trainable part). Built
from awaitables, a :class:`TrajectoryGroup` is itself awaitable: each rollout runs as its own
task under a fresh trajectory id and the group's id, so every call it makes through a client
from ``model.openai_client()`` (or any client given to ``flywheel.trajectory``) is tagged.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Awaitable, Generator, Iterable, Iterator
from typing import Annotated, Any, cast

from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, BeforeValidator, Field

from flywheel import progress
from flywheel.tagging import Tags, activate, deactivate, new_id

__all__ = ["History", "MetadataValue", "RolloutException", "Trajectory", "TrajectoryGroup"]

MetadataValue = float | int | str | bool | None
Message = dict[str, Any]
Messages = list[ChatCompletionMessageParam]  # what a request's `messages` takes
MessageOrChoice = Annotated[Choice | Message, Field(union_mode="left_to_right")]
Tools = list[dict[str, Any]]


def _item(value: Any) -> Any:
    """A serialized Choice becomes a Choice again; another pydantic message (``choice.message``) a plain dict."""
    if isinstance(value, dict) and "message" in value and "finish_reason" in value and "role" not in value:
        return Choice.model_validate(value)
    if isinstance(value, BaseModel) and not isinstance(value, Choice):
        return value.model_dump(exclude_none=True)
    return value


MessagesAndChoices = Annotated[list[MessageOrChoice], BeforeValidator(lambda items: [_item(i) for i in items])]


def choice_message(choice: Choice) -> Message:
    """A Choice as the assistant message the model's next request carries."""
    message: Message = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [call.model_dump(exclude_none=True) for call in choice.message.tool_calls]
    return message


class History(BaseModel):
    """A conversation of its own inside a trajectory (ART's ``additional_histories``: sub-agents, compaction)."""

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None

    def messages(self) -> Messages:
        return cast(Messages, [choice_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices])


class Trajectory(BaseModel):
    """One attempt at a task: the messages and the model's choices, the tools, a reward, metrics and metadata.

    ``id`` is the gateway's trajectory id when the SDK knows it: set for rollouts run inside an
    awaited :class:`TrajectoryGroup` that made calls through a tagging client.
    """

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    id: str | None = None

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"

    def messages(self) -> Messages:
        """The conversation as plain messages (each Choice as its assistant message): what a request sends."""
        return cast(Messages, [choice_message(m) if isinstance(m, Choice) else m for m in self.messages_and_choices])

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """ART's end-of-rollout call; nothing to do here (timing comes from the gateway's turns)."""
        return self


class RolloutException(BaseModel):
    """A rollout that raised, kept on its group (ART's ``PydanticException``)."""

    type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> RolloutException:
        return cls(type=type(exc).__qualname__, message=str(exc),
                   traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class TrajectoryGroup(BaseModel):
    """Attempts at the same task; only their rewards relative to each other matter (GRPO, RULER).

    ``TrajectoryGroup(trajectories)`` is a group; ``TrajectoryGroup(awaitables)`` is an awaitable of
    one (see the module docstring). ``id`` is the group id its rollouts' calls carried.
    """

    trajectories: list[Trajectory]
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    exceptions: list[RolloutException] = Field(default_factory=list)
    id: str | None = None

    def __new__(cls, trajectories: Iterable[Trajectory | BaseException] | Iterable[Awaitable[Trajectory]] = (), *,
                metadata: dict[str, MetadataValue] | None = None, exceptions: list[Any] | None = None,
                id: str | None = None) -> TrajectoryGroup:
        items = list(trajectories)
        if any(inspect.isawaitable(item) for item in items):
            pending = PendingGroup(cast(list[Awaitable[Trajectory]], items), metadata=metadata,
                                   exceptions=list(exceptions or []), group_id=id)
            return cast(TrajectoryGroup, pending)  # typed as the group it yields: both are awaited to one
        group = super().__new__(cls)
        group.__init__(items, metadata=metadata, exceptions=exceptions, id=id)  # type: ignore[misc]
        return group

    def __init__(self, trajectories: Iterable[Trajectory | BaseException] | Iterable[Awaitable[Trajectory]] = (), *,
                 metadata: dict[str, MetadataValue] | None = None, exceptions: list[Any] | None = None,
                 id: str | None = None) -> None:
        if "trajectories" in self.__dict__:  # __new__ built it; Python calls __init__ again with a spent iterable
            return
        items = list(trajectories)
        failures = [item for item in items if isinstance(item, BaseException)] + list(exceptions or [])
        super().__init__(trajectories=[item for item in items if not isinstance(item, BaseException)],
                         metadata=metadata or {}, id=id,
                         exceptions=[RolloutException.of(e) if isinstance(e, BaseException) else e for e in failures])

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        """A group is already gathered: awaiting it gives itself (so groups and pending groups mix freely)."""
        return self
        yield  # a generator that finishes at once


class PendingGroup:
    """The awaitable ``TrajectoryGroup(awaitables)`` returns: the rollouts run when it is awaited."""

    def __init__(self, rollouts: list[Awaitable[Trajectory]], *, metadata: dict[str, MetadataValue] | None,
                 exceptions: list[BaseException], group_id: str | None) -> None:
        self._rollouts = rollouts
        self._metadata = metadata
        self._exceptions = exceptions
        self.group_id = group_id or new_id("group")
        self._num_trajectories = len(rollouts)  # what gather counts in its progress total (ART's attribute)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self._collect().__await__()

    def _start(self, rollout: Awaitable[Trajectory]) -> tuple[Tags, asyncio.Future[Trajectory]]:
        tags = Tags(trajectory_id=new_id("traj"), group_id=self.group_id)
        token = activate(tags)  # the task copies the context now: its calls carry these tags
        try:
            return tags, asyncio.ensure_future(rollout)
        finally:
            deactivate(token)

    async def _collect(self) -> TrajectoryGroup:
        context = progress.current()
        started = [self._start(rollout) for rollout in self._rollouts]
        results: dict[int, Trajectory] = {}
        failures = list(self._exceptions)
        position = {future: index for index, (_, future) in enumerate(started)}
        pending = set(position)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=position.__getitem__):
                    tags = started[position[future]][0]
                    try:
                        trajectory = future.result()
                    except Exception as exc:
                        failures.append(exc)
                        context.failed()
                        if context.too_many_exceptions():
                            raise
                        continue
                    if trajectory.id is None and tags.requests:
                        trajectory.id = tags.trajectory_id
                    results[position[future]] = trajectory
                    context.record(trajectory.reward, trajectory.metrics)
                    context.advance(1)
        finally:
            for future in pending:
                future.cancel()
        return TrajectoryGroup([results[i] for i in sorted(results)], metadata=self._metadata, exceptions=failures,
                               id=self.group_id)
