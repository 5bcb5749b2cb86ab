"""``LocalBackend`` runs a gateway of its own and stops it: on leaving the block (also when it raised),
on ``close()``; and a gateway that cannot start is reported with its log."""

from __future__ import annotations

from pathlib import Path

import pytest

import flywheel
from flywheel.local import LocalBackend


async def test_the_gateway_serves_the_model_and_stops_when_the_rollout_raises(tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    backend = LocalBackend(path=tmp_path / "local")
    model = flywheel.TrainableModel(name="local-agent", project="sdk-local", base_model=str(tiny_model))
    with pytest.raises(RuntimeError, match="the rollout broke"):
        async with backend:
            await model.register(backend)
            process = backend.process
            assert process is not None and backend.running
            reply = await model.openai_client().chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].message.content is not None
            assert await model.get_step() == 0
            assert f'model = "{tiny_model}"' in backend.config_file.read_text()
            raise RuntimeError("the rollout broke")
    assert process.poll() is not None and not backend.running and backend.closed
    assert backend.admin_key is not None and backend.admin_key not in backend.config_file.read_text()


async def test_a_gateway_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    backend = LocalBackend(path=tmp_path / "broken", extra_config='max_body_bytes = "lots"', startup_timeout_s=120)
    model = flywheel.TrainableModel(name="agent", project="sdk-local", base_model="tiny")
    try:
        with pytest.raises(flywheel.GatewayStartError, match="exited with status 2") as info:
            await model.register(backend)
        assert "max_body_bytes" in str(info.value)  # the gateway's own one-line error, from its log
    finally:
        await backend.close()
    assert backend.process is None
