"""The typed store interface: both implementations match the Protocol, and the store process's side of the wire
checks what it is sent (an unknown method, a missing or ill-typed argument) before it runs anything."""

from __future__ import annotations

import inspect
from typing import Any, get_type_hints

import pytest

from flywheel.capture.store import Store
from flywheel.gateway.core.config import Settings
from flywheel.gateway.core.errors import BadRequest
from flywheel.gateway.core.store_api import METHODS, AliasVersions, StoreApi
from flywheel.gateway.serving.store_client import StoreClient
from flywheel.gateway.storeproc import store_ops
from flywheel.gateway.storeproc.store_api_local import LocalStore, answer

SETTINGS = Settings(aliases={"a": {"engine": "local"}}, engines={"local": {"kind": "local", "model": "m"}})


@pytest.mark.parametrize("implementation", [LocalStore, StoreClient])
def test_both_implementations_have_every_method_with_the_protocols_signature(implementation: type) -> None:
    assert METHODS and "serving" in METHODS and "ui_group" in METHODS
    for name in METHODS:
        ours, spec = getattr(implementation, name), getattr(StoreApi, name)
        assert inspect.iscoroutinefunction(ours), name
        assert inspect.signature(ours) == inspect.signature(spec), name
        assert get_type_hints(ours) == get_type_hints(spec), name


async def test_the_wire_refuses_an_unknown_method_and_bad_arguments(store: Store) -> None:
    local = LocalStore(store, SETTINGS)
    with pytest.raises(BadRequest, match="no method 'drop_everything'"):
        await answer(local, "drop_everything", {})
    with pytest.raises(BadRequest, match="no method '__init__'"):
        await answer(local, "__init__", {})
    with pytest.raises(BadRequest) as missing:
        await answer(local, "pending", {})
    assert missing.value.param == "alias"
    with pytest.raises(BadRequest) as ill_typed:
        await answer(local, "decide", {"alias": "a", "version": "seven", "status": "rejected", "reason": "r"})
    assert ill_typed.value.param == "version"
    with pytest.raises(BadRequest) as extra:
        await answer(local, "serving", {"alias": "a"})
    assert extra.value.param == "alias"


async def test_an_answer_is_the_return_types_json_and_reads_back_into_it(store: Store) -> None:
    """What the store process sends for ``serving`` and ``reserve_version`` parses into the Protocol's models."""
    local = LocalStore(store, SETTINGS)
    reserved = await answer(local, "reserve_version", {"alias": "a", "base_model": "m", "status": "candidate",
                                                       "path": "/adapters/a/1", "source": "manual"})
    assert reserved["version"] == 1 and reserved["status"] == "candidate" and isinstance(reserved["created_at"], str)
    wire: dict[str, Any] = await answer(local, "serving", {})
    rows = {alias: AliasVersions.model_validate(row) for alias, row in wire.items()}
    assert rows["a"].serving is None and rows["a"].in_flight is not None and rows["a"].in_flight.version == 1
    assert rows["a"] == store_ops.serving(store, SETTINGS)["a"]
