"""The composition root: build the FastAPI app from :class:`Settings`.

Run it with ``flywheel serve`` (or ``python -m flywheel.gateway serve``). The app owns its
engines and its store process (:mod:`flywheel.gateway.storeproc.main`): they start in the lifespan
and stop on shutdown. The store-backed routes are the store process's; the gateway
forwards them (same paths, same auth), so clients see one server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from flywheel.capture.store import printable_url
from flywheel.gateway.core.auth import Authenticator
from flywheel.gateway.core.config import LocalEngineConfig, OpenAIEngineConfig, Settings
from flywheel.gateway.core.discovery import announce_when_listening, withdraw
from flywheel.gateway.core.error_handlers import install_error_handlers
from flywheel.gateway.core.errors import OpenAIError
from flywheel.gateway.core.http import json_response, read_body
from flywheel.gateway.core.openapi import openapi_document
from flywheel.gateway.core.processes import tune_gc
from flywheel.gateway.core.store_wire import redactor_for
from flywheel.gateway.serving.engines.base import Engine
from flywheel.gateway.serving.gateway_state import GatewayState
from flywheel.gateway.serving.loop.leader import shared_store
from flywheel.gateway.serving.loop.promotion import restore_serving
from flywheel.gateway.serving.loop.scheduler import Loop
from flywheel.gateway.serving.observability.loop_jobs import Observability
from flywheel.gateway.serving.routes import admin, completions, loop_admin
from flywheel.gateway.serving.routes import training_api as training
from flywheel.gateway.serving.routing import ModelRouter
from flywheel.gateway.serving.served_model import ServedModel
from flywheel.gateway.serving.store_client import StoreClient
from flywheel.gateway.serving.store_link import StoreLink
from flywheel.gateway.serving.ui.routes import install as install_dashboard
from flywheel.gateway.storeproc.routes import STORE_ROUTERS

log = logging.getLogger("flywheel.gateway")


def make_engine(config: LocalEngineConfig | OpenAIEngineConfig, settings: Settings) -> Engine:
    """An engine for one ``[engines.NAME]`` table; torch is imported only for a local engine."""
    if isinstance(config, OpenAIEngineConfig):
        from flywheel.gateway.serving.engines.openai_upstream import OpenAIUpstreamEngine

        return OpenAIUpstreamEngine(config)
    from flywheel.gateway.serving.engines.local import LocalEngine

    return LocalEngine(config, settings.data_dir, threads=decode_threads(config, settings))


def decode_threads(config: LocalEngineConfig, settings: Settings) -> int:
    """``engines.X.threads``, or the cores a training child (the loop's or the admin API's) leaves free (>= 1)."""
    if config.threads:
        return config.threads
    return max(1, (os.cpu_count() or 1) - settings.loop.train_threads)


def retire_after_s(settings: Settings) -> float:
    """How long a replaced adapter stays loaded: replicas sharing an engine switch within ``follow_s`` each."""
    replicas = settings.replicas
    if replicas.retire_after_s is not None:
        return replicas.retire_after_s
    return 2 * replicas.follow_s + 30 if shared_store(settings.database) else 0.0


async def start_gateway(settings: Settings) -> GatewayState:
    """Start every engine and the store process, load the aliases' adapters, and build the state."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store_link = StoreLink(settings, redactor_for(settings))
    engines: dict[str, Engine] = {}

    async def start_engines() -> None:
        for name, config in settings.engines.items():
            engine = make_engine(config, settings)
            await engine.start()
            engines[name] = engine

    await asyncio.gather(start_engines(), store_link.start())  # the store process starts meanwhile
    served: dict[str, ServedModel] = {}
    for alias, cfg in settings.aliases.items():
        engine_cfg = settings.engines[cfg.engine]
        base = cfg.base_model or (engine_cfg.model if isinstance(engine_cfg, LocalEngineConfig) else alias)
        served[alias] = ServedModel(alias=alias, engine_name=cfg.engine, engine=engines[cfg.engine],
                                    base_model=base)
    router = ModelRouter(settings.routing, served, retire_after_s=retire_after_s(settings))
    state = GatewayState(settings=settings, engines=engines, router=router,
                         auth=Authenticator.from_config(settings.auth), store_link=store_link,
                         store=StoreClient(store_link, keep_versions=not shared_store(settings.database)),
                         started_at=int(time.time()))
    await restore_serving(state)  # what the store says serves each alias (a restart never undoes a promotion)
    state.metrics.watch_capture(store_link.capture_counts)
    return state


def build_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await start_gateway(settings)
        observability = Observability.start(settings, state.store)  # traces, tracking: off by default
        state.metrics.registry.register(observability.collector())
        loop = Loop(state, observability)
        await loop.start()
        app.state.gateway, app.state.metrics, app.state.loop = state, state.metrics, loop
        app.state.observability = observability
        announcing = asyncio.create_task(announce_when_listening(settings))
        tune_gc()  # everything the gateway keeps is allocated by now
        log.info("flywheel gateway ready: aliases=%s engines=%s store=%s loop=%s (%s)",
                 [s.alias for s in state.router.all()], list(state.engines), printable_url(settings.database),
                 "on" if settings.loop.enabled else "off", loop.leadership.role)
        try:
            yield
        finally:
            announcing.cancel()
            withdraw(settings)
            await loop.stop()
            await observability.close()
            await state.store_link.aclose()  # SIGTERM: the store process writes everything it was sent
            for engine in state.engines.values():
                await engine.aclose()

    app = FastAPI(title="Flywheel gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(completions.router)
    app.include_router(admin.router)
    app.include_router(training.router)
    app.include_router(loop_admin.router)
    for store_router in STORE_ROUTERS:  # served by the store process: the same paths, forwarded
        for route in store_router.routes:
            assert isinstance(route, APIRoute) and route.methods
            app.add_route(route.path, forward_to_store, methods=list(route.methods))
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    install_dashboard(app, settings)  # /flywheel/ui (docs/dashboard.md)
    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    install_error_handlers(app)
    return app


async def openapi_json(request: Request) -> Response:
    """The OpenAPI document of every route the gateway serves; behind the admin key when one is configured."""
    state = GatewayState.of(request)
    if state.settings.auth.admin_key is not None:
        state.auth.admin(request)
    return json_response(openapi_document(request.app, STORE_ROUTERS))


async def forward_to_store(request: Request) -> Response:
    state = GatewayState.of(request)
    body = await read_body(request, state.settings.max_body_bytes)  # 413 here, before forwarding
    return await state.store_link.forward(request, body)


async def healthz(request: Request) -> Response:
    """200 when every engine answers its health check, 503 otherwise."""
    state = GatewayState.of(request)
    engines: dict[str, object] = {}
    healthy = True
    for name, engine in state.engines.items():
        try:
            engines[name] = await engine.health()
        except OpenAIError as exc:
            engines[name] = {"error": exc.message}
            healthy = False
    store = "ok" if state.store_link.up else "restarting"  # meanwhile capture goes to the spool
    body = {"status": "ok" if healthy else "degraded", "engines": engines, "store": store}
    return Response(orjson.dumps(body), status_code=200 if healthy else 503, media_type="application/json")


async def metrics(request: Request) -> Response:
    state = GatewayState.of(request)
    await state.store_link.refresh_capture_counts()
    await request.app.state.observability.refresh(state.store_link)
    return Response(state.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")
