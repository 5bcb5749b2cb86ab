"""The composition root: build the FastAPI app from :class:`Settings`.

Run it with ``flywheel serve`` (or ``python -m gateway serve``). The app owns its
engines: they start in the lifespan and close on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from capture.recorder import Recorder, Spool
from capture.redaction import Redactor
from capture.store import Store
from gateway import admin_api, feedback_api, openai_api, stored_api, training_api, trajectories_api
from gateway.auth import Authenticator
from gateway.config import LocalEngineConfig, OpenAIEngineConfig, Settings
from gateway.engines.base import Engine
from gateway.errors import BadRequest, OpenAIError
from gateway.protocol import format_param
from gateway.routing import ModelRouter, ServedModel
from gateway.state import GatewayState
from gateway.training import promoted_version

log = logging.getLogger("flywheel.gateway")


def make_engine(config: LocalEngineConfig | OpenAIEngineConfig, settings: Settings) -> Engine:
    """An engine for one ``[engines.NAME]`` table; torch is imported only for a local engine."""
    if isinstance(config, OpenAIEngineConfig):
        from gateway.engines.openai_upstream import OpenAIUpstreamEngine

        return OpenAIUpstreamEngine(config)
    from gateway.engines.local import LocalEngine

    return LocalEngine(config, settings.data_dir)


async def start_gateway(settings: Settings) -> GatewayState:
    """Start every engine, load the aliases' initial adapters, and build the state."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engines: dict[str, Engine] = {}
    for name, config in settings.engines.items():
        engine = make_engine(config, settings)
        await engine.start()
        engines[name] = engine
    served: dict[str, ServedModel] = {}
    for alias, cfg in settings.aliases.items():
        engine_cfg = settings.engines[cfg.engine]
        base = cfg.base_model or (engine_cfg.model if isinstance(engine_cfg, LocalEngineConfig) else alias)
        served[alias] = ServedModel(alias=alias, engine_name=cfg.engine, engine=engines[cfg.engine],
                                    base_model=base)
    router = ModelRouter(settings.routing, served)
    store = await asyncio.to_thread(Store, settings.database)
    for alias, cfg in settings.aliases.items():
        promoted = None if cfg.adapter else await asyncio.to_thread(promoted_version, store, alias)
        if cfg.adapter:
            await router.switch_adapter(alias, cfg.adapter)
        elif promoted is not None:  # what training promoted last time keeps being served after a restart
            await router.switch_adapter(alias, promoted.path, version=promoted.version)
    auth = Authenticator([k.get_secret_value() for k in settings.auth.api_keys],
                         settings.auth.admin_key.get_secret_value() if settings.auth.admin_key else None)
    redaction = settings.capture.redaction
    redactor = Redactor(builtin=redaction.builtin, patterns=redaction.patterns) \
        if redaction.builtin or redaction.patterns else None
    recorder = Recorder(store, Spool(settings.spool_path), redactor=redactor,
                        queue_size=settings.capture.queue_size, batch_size=settings.capture.batch_size,
                        batch_wait_s=settings.capture.batch_wait_s, retry_s=settings.capture.retry_s)
    state = GatewayState(settings=settings, engines=engines, router=router, auth=auth, store=store,
                         recorder=recorder, started_at=int(time.time()))
    state.metrics.watch_capture(recorder.stats)
    return state


def start_jobs(state: GatewayState) -> AsyncIOScheduler:
    """Background jobs: close idle trajectories, form groups from closed ones."""
    scheduler = AsyncIOScheduler()
    store, settings = state.store, state.settings
    if store is not None:
        idle_s = settings.capture.idle_close_s
        scheduler.add_job(asyncio.to_thread, "interval", args=[store.close_idle, idle_s], id="close-idle",
                          seconds=max(1.0, min(60.0, idle_s / 4)), max_instances=1, coalesce=True)
        scheduler.add_job(asyncio.to_thread, "interval", id="form-groups", seconds=settings.groups.form_every_s,
                          args=[feedback_api.run_group_formation, store, settings.groups], max_instances=1,
                          coalesce=True)
    scheduler.start()
    return scheduler


def build_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await start_gateway(settings)
        app.state.gateway = state
        if state.recorder is not None:
            state.recorder.start()
            await state.recorder.reingest()  # what an earlier run left in the spool
        scheduler = start_jobs(state)
        log.info("flywheel gateway ready: aliases=%s engines=%s store=%s",
                 [s.alias for s in state.router.all()], list(state.engines), settings.database)
        try:
            yield
        finally:
            scheduler.shutdown(wait=False)
            if state.recorder is not None:
                await state.recorder.drain()  # SIGTERM: nothing queued is lost
            if state.store is not None:
                state.store.close()
            for engine in state.engines.values():
                await engine.aclose()

    app = FastAPI(title="Flywheel gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai_api.router)
    app.include_router(admin_api.router)
    app.include_router(stored_api.router)
    app.include_router(trajectories_api.router)
    app.include_router(feedback_api.router)
    app.include_router(training_api.router)
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    return app


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
    body = {"status": "ok" if healthy else "degraded", "engines": engines}
    return Response(orjson.dumps(body), status_code=200 if healthy else 503, media_type="application/json")


async def metrics(request: Request) -> Response:
    return Response(GatewayState.of(request).metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def _error_response(request: Request, exc: OpenAIError) -> Response:
    state: GatewayState | None = getattr(request.app.state, "gateway", None)
    if state is not None:
        state.metrics.errors.labels(str(exc.status_code), str(exc.code)).inc()
    return Response(exc.to_json(), status_code=exc.status_code, media_type="application/json")


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return _error_response(request, exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    error = exc.errors()[0]
    param = format_param(tuple(p for p in error["loc"] if p != "body"))
    return _error_response(request, BadRequest(f"Invalid value for '{param}': {error['msg']}", param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    error = OpenAIError(str(exc.detail), status_code=exc.status_code, error_type="invalid_request_error",
                        code="not_found" if exc.status_code == 404 else None)
    return _error_response(request, error)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    body = OpenAIError("The server had an error while processing your request.").to_dict()
    return JSONResponse(body, status_code=500)
