"""ART's loop through a real gateway: two training steps on the tiny model give two served adapter versions.

Each step gathers groups of rollouts with ``model.openai_client()``, ranks each group's answers in
``after_each`` (so every group has distinct rewards to learn from), and trains one step — first
with ``model.train(config=TrainConfig(...))``, then with ``backend.train(...)`` and ART's newer
keyword arguments. Evaluation metrics go to ``model.log``; ``delete_checkpoints`` keeps the best and
the latest version, and the gateway refuses to delete the one it serves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import flywheel
import pytest

from tests.conftest import ADMIN_KEY
from tests.gateway_process import GatewayProcess

QUESTIONS = ["Name a fruit.", "Name a colour."]


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(tmp_path_factory.mktemp("train"), f"""
[engines.local]
model = "{tiny_model}"
default_max_tokens = 6
[aliases.agent]
engine = "local"
[auth]
admin_key = "{ADMIN_KEY}"
[train.args]
lora_r = 8
lora_alpha = 16
precision = "fp32"
gradient_accumulation_steps = 1
max_prompt_tokens = 128
max_completion_tokens = 16
seed = 0
""", name="train").start()
    yield process
    process.stop()


async def rollout(model: flywheel.Model, question: str) -> flywheel.Trajectory:
    trajectory = flywheel.Trajectory(messages_and_choices=[{"role": "user", "content": question}], reward=0)
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=trajectory.messages(), max_tokens=6, temperature=1.0)
    trajectory.messages_and_choices.append(completion.choices[0])
    return trajectory


async def ranked(group: flywheel.TrajectoryGroup) -> flywheel.TrajectoryGroup:
    """Rewards by rank of answer length (ties by position): distinct in every group, so GRPO has a signal."""
    order = sorted(range(len(group)), key=lambda i: (len(group.trajectories[i].messages()[-1]["content"] or ""), i))
    for rank, index in enumerate(order):
        group.trajectories[index].reward = rank / (len(group) - 1)
    return group


async def gather(model: flywheel.TrainableModel) -> list[flywheel.TrajectoryGroup]:
    return await flywheel.gather_trajectory_groups(
        (flywheel.TrajectoryGroup(rollout(model, q) for _ in range(3)) for q in QUESTIONS), after_each=ranked)


def evaluated(reward: float) -> flywheel.TrajectoryGroup:
    return flywheel.TrajectoryGroup([flywheel.Trajectory(messages_and_choices=[], reward=reward)])


async def test_two_art_steps_serve_two_versions(gateway: GatewayProcess) -> None:
    backend = flywheel.Gateway(gateway.url, admin_key=ADMIN_KEY)
    model = flywheel.TrainableModel(name="agent", project="sdk-train", base_model="tiny")
    await model.register(backend)
    assert await model.get_step() == 0

    first = await model.train(await gather(model), config=flywheel.TrainConfig(learning_rate=1e-3))
    assert (first.status, first.step, first.promoted) == ("finished", 1, True)
    assert first.checkpoint_path is not None and (Path(first.checkpoint_path) / "adapter_config.json").is_file()
    assert "losses/loss" in first.metrics
    await model.log([evaluated(0.2)], split="val")

    second = await backend.train(model, await gather(model), learning_rate=1e-3, epsilon_high=0.28,
                                 scale_rewards=False)
    assert (second.status, second.step) == ("finished", 2)
    assert await model.get_step() == 2
    assert backend.alias("agent")["adapter"] == "agent@2"
    assert second.checkpoint_path is not None
    resolved = json.loads((Path(second.checkpoint_path) / "flywheel_round.json").read_text())["config"]["args"]
    assert (resolved["epsilon_high"], resolved["advantage_scale"], resolved["learning_rate"]) == (0.28, "none", 1e-3)
    await model.log([evaluated(0.8)], split="val")

    statuses = {v["version"]: v["status"] for v in backend.versions("agent")}
    assert statuses == {1: "retired", 2: "promoted"}
    await model.delete_checkpoints("val/reward")  # the best is the latest: version 1 goes
    statuses = {v["version"]: v["status"] for v in backend.versions("agent")}
    assert statuses == {1: "deleted", 2: "promoted"}
    assert not Path(first.checkpoint_path).exists() and Path(second.checkpoint_path).exists()
    with pytest.raises(flywheel.GatewayError) as refused:
        backend.delete_version("agent", 2)
    assert (refused.value.status_code, refused.value.code) == (409, "version_in_use")
    with pytest.raises(flywheel.NotFoundError):
        backend.delete_version("agent", 9)
    reply = await model.openai_client().chat.completions.create(model="agent", max_tokens=2,
                                                                messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None  # version 2 still serves
    await backend.close()
