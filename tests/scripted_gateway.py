"""A gateway over a ScriptedOpenAI upstream, one per test module, as that module's fixtures.

Not in tests/support.py: bench/loop.py imports that one, and this one needs pytest and the test modules' helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.gateway_process import GatewayProcess
from tests.scripted_openai import Reply, ScriptedOpenAI
from tests.test_stored_completions import gateway_config


def scripted_gateway_fixtures(reply: Callable[[dict[str, Any]], Reply], keys: list[str], name: str) -> tuple[Any, Any]:
    """Module fixtures ``gateway`` (one gateway over a ScriptedOpenAI answering with ``reply``, client ``keys``,
    admin key "adm") and ``key`` (a key of its own for each test, so its trajectories are the ones listed for it)."""

    @pytest.fixture(scope="module", name="gateway")
    def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
        with ScriptedOpenAI(reply=reply) as upstream:
            config = gateway_config(upstream, *keys, admin="adm")
            process = GatewayProcess(tmp_path_factory.mktemp(name), config).start()
            yield process
            process.stop()

    unused_keys = iter(keys)

    @pytest.fixture(name="key")
    def key() -> str:
        return next(unused_keys)

    return gateway, key
