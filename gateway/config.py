"""Gateway configuration: one TOML file plus ``FLYWHEEL_*`` environment variables.

Precedence (highest first): constructor arguments, environment variables
(``FLYWHEEL_PORT=9000``, nested with ``__``: ``FLYWHEEL_AUTH__ADMIN_KEY=...``), the TOML
file, the embedded defaults below. With nothing given, the gateway serves the tiny
model built into ``<data_dir>/models/tiny`` through the local engine, and routes every
model name to the alias ``flywheel``. ``deploy/flywheel.example.toml`` is the annotated
reference.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Container
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from judge.rewards import RewardPolicy
from judge.ruler import JudgeConfig

TINY_MODEL = "tiny"  # the model name that means "the tiny model built offline into the data dir"


class LocalEngineConfig(BaseModel):
    """In-process transformers + peft engine (development, tests, small deployments)."""

    kind: Literal["local"] = "local"
    model: str = TINY_MODEL  # "tiny", a local model directory, or an HF id present in the HF cache
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on GPU, float32 on CPU
    default_max_tokens: int = 256  # used when a request sets neither max_tokens nor max_completion_tokens
    max_batch_n: int = 16  # largest n one request may ask for


class OpenAIEngineConfig(BaseModel):
    """Any OpenAI-compatible upstream (vLLM with --enable-lora in production)."""

    kind: Literal["openai"] = "openai"
    base_url: str  # e.g. http://127.0.0.1:8001/v1
    api_key: SecretStr | None = None  # sent upstream as a Bearer token; never logged
    timeout_s: float = 600.0  # read timeout: longest silence tolerated between bytes
    connect_timeout_s: float = 5.0
    max_connections: int = 512
    request_token_ids: bool = True  # ask vLLM for return_token_ids + logprobs (stripped for clients)


EngineConfig = LocalEngineConfig | OpenAIEngineConfig


class AliasConfig(BaseModel):
    """A served model name: which engine, which base model, which adapter."""

    engine: str = "local"  # a key of [engines]
    base_model: str | None = None  # the model name the engine serves; defaults to the engine's model
    adapter: str | None = None  # PEFT adapter directory served from start-up (else its latest promoted version)
    train_model: str | None = None  # base weights to train (directory or cached HF id); default: the local model


class RoutingConfig(BaseModel):
    """Maps the model names clients send to aliases, so agents keep their code."""

    routes: dict[str, str] = Field(default_factory=dict)  # exact name or glob pattern -> alias
    default: str | None = None  # alias for names nothing else matches; unset: the first alias; "": 404

    def resolve(self, requested: str, aliases: Container[str]) -> str | None:
        """Alias for a requested model name: alias itself, exact route, first glob, default."""
        if requested in aliases:
            return requested
        if requested in self.routes:
            return self.routes[requested]
        for pattern, alias in self.routes.items():
            if fnmatch.fnmatchcase(requested, pattern):
                return alias
        return self.default or None


class AuthConfig(BaseModel):
    """Client keys (Bearer) and the admin key. Empty api_keys means no client auth."""

    api_keys: list[SecretStr] = Field(default_factory=list)
    admin_key: SecretStr | None = None  # unset: admin API answers loopback clients only


class RedactionConfig(BaseModel):
    """What is scrubbed from captured text before it is written anywhere."""

    builtin: bool = True  # e-mail addresses, phone numbers, card-like numbers, API-key-like tokens
    patterns: list[str] = Field(default_factory=list)  # extra regexes; matches become [REDACTED:CUSTOM_i]


class CaptureConfig(BaseModel):
    """Recording traffic as trajectories (architecture §4, §8)."""

    enabled: bool = True  # default for requests without an X-Flywheel-Capture header
    sample_rate: float = Field(default=1.0, ge=0, le=1)  # fraction of (enabled) requests captured
    database: str | None = None  # unset: <data_dir>/flywheel.duckdb; or a SQLAlchemy URL (postgresql://...)
    spool_path: Path | None = None  # unset: <data_dir>/spool/turns.jsonl
    idle_close_s: float = 600.0  # a trajectory with no new turn for this long is closed
    queue_size: int = 10_000  # turns waiting for the writer; beyond it they go to the spool
    batch_size: int = 1024  # turns per store transaction
    # Longest wait to fill a batch: what a crash of the store process can lose (a gateway crash loses
    # ~nothing: docs/capture.md). A reader that needs the latest turns cuts the wait short.
    batch_wait_s: float = 1.0
    # How often the gateway hands what it answered to the store process (one socket write): what a
    # crash of the gateway can lose. Each write wakes the store process; 50 ms instead of 10 ms took
    # its event loop's CPU per turn from ~25 to ~11 us (measured).
    handoff_s: float = Field(default=0.05, gt=0, le=1)
    retry_s: float = 2.0  # how often the spool is retried while the store refuses writes
    # The store process's niceness: on a busy machine the request path gets the cores first and capture
    # catches up in the gaps (the queue and the spool absorb the backlog). 0 = the gateway's priority.
    store_nice: int = Field(default=10, ge=0, le=19)
    redaction: RedactionConfig = Field(default_factory=RedactionConfig)
    # Several replicas on one PostgreSQL store: a turn whose last answer is not stored yet waits this long for
    # it (the replica that gave it may still be writing it) before it is linked without it. Unset: 5 s on a
    # shared store, 0 on DuckDB (one store process reads every turn in order).
    link_wait_s: float | None = Field(default=None, ge=0, le=300)


class GroupsConfig(BaseModel):
    """Where GRPO groups come from (architecture §5)."""

    min_size: int = Field(default=2, ge=2)  # smaller groups wait for members (or are dropped: forks)
    max_size: int = Field(default=8, ge=2)  # larger ones are cut, oldest first; never padded
    task_window_s: float = 3600.0  # same-task trajectories must start within this span
    cohorts: bool = False  # also group by system prompt + tools alone (weaker signal)
    fork_fraction: float = Field(default=0.0, ge=0, le=1)  # share of captured chat turns forked
    fork_k: int = Field(default=3, ge=1, le=16)  # extra samples per forked turn
    form_every_s: float = Field(default=60.0, gt=0)  # how often closed trajectories are grouped


class TrainConfig(BaseModel):
    """``flywheel train``: GRPO settings (trainer/grpo.py: GRPOArgs) and batch size."""

    args: dict[str, Any] = Field(default_factory=dict)  # GRPOArgs fields, e.g. {learning_rate = 1e-5, max_steps = 8}
    tiny_defaults: bool = True  # training the built-in tiny model starts from GRPOArgs.tiny() (lr 1e-2, r 16)
    max_groups: int = Field(default=64, ge=1)  # scored groups per round
    # true: rounds are trained by trainer workers (`flywheel train --gateway URL` on a GPU machine, docs/deploy.md)
    # through the admin API; the loop never trains in a child process of its own (the gateway needs no torch),
    # gates what the workers report, and fails a round no worker reported within loop.train_timeout_s
    workers: bool = False


class GateConfig(BaseModel):
    """The offline promotion gate: held-out contexts answered by the candidate and the serving version."""

    offline: bool = True  # off: candidates go straight to the canary (or are promoted when that is off too)
    contexts: int = Field(default=32, ge=1)  # M recent held-out contexts per candidate
    min_contexts: int = Field(default=8, ge=1)  # fewer held out so far: the candidate waits for more traffic
    holdout_fraction: float = Field(default=0.1, ge=0, le=0.5)  # of ungrouped trajectories; never trained on
    win_rate: float = Field(default=0.5, ge=0, le=1)  # pass when (wins + ties / 2) / M reaches this
    reward_hook: str | None = None  # "module:function" or an http(s) URL; unset: RULER with the [judge] model
    max_tokens: int = Field(default=256, ge=1)  # per answer
    temperature: float = Field(default=0.0, ge=0, le=2)  # 0: greedy, the versions' most likely answers


class CanaryConfig(BaseModel):
    """The online gate: a share of live conversations on the candidate, compared by a sequential test."""

    enabled: bool = True
    fraction: float = Field(default=0.1, gt=0, lt=1)  # of new conversations; sticky per conversation
    alpha: float = Field(default=0.05, gt=0, lt=1)  # bound on false promotions (and on false rejections)
    margin: float = Field(default=0.0, ge=0)  # > 0: promote when not worse than the serving version by this
    max_pairs: int = Field(default=2000, ge=1)  # stop here; the decision is on_max
    on_max: Literal["reject", "promote"] = "reject"  # neither better nor worse was shown by max_pairs
    reward_min: float = 0.0  # rewards are clipped to [reward_min, reward_max] for the test (it needs bounds)
    reward_max: float = 1.0


class MonitorConfig(BaseModel):
    """After a promotion: the same test against the predecessor's recorded rewards; a drop rolls back."""

    enabled: bool = True
    alpha: float = Field(default=0.05, gt=0, lt=1)  # bound on false rollbacks
    margin: float = Field(default=0.0, ge=0)  # roll back when worse than the predecessor by more than this
    max_pairs: int = Field(default=2000, ge=1)  # the monitor ends after this many pairs without a drop
    baseline: int = Field(default=1000, ge=1)  # the predecessor's most recent rewards compared against


class LoopConfig(BaseModel):
    """The loop that turns traffic into promoted adapters by itself (docs/loop.md)."""

    enabled: bool = True
    tick_s: float = Field(default=10.0, gt=0)  # how often the train, gate and A/B jobs look for work
    score_every_s: float = Field(default=30.0, gt=0)  # how often closed groups are scored
    min_groups: int = Field(default=8, ge=1)  # train when this many scored groups are waiting ...
    train_every_s: float = Field(default=3600.0, gt=0)  # ... or when the last round is this old and one waits
    train_nice: int = Field(default=10, ge=0, le=19)  # the training child's niceness: serving keeps the CPU
    train_threads: int = Field(default=1, ge=0)  # torch threads in the training child (0: torch's default)
    train_timeout_s: float = Field(default=3600.0, gt=0)  # a round running longer is killed and recorded failed
    gate: GateConfig = Field(default_factory=GateConfig)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)


class TelemetryConfig(BaseModel):
    """OpenTelemetry traces over OTLP/HTTP (docs/observability.md): on when an endpoint is set here or in
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; off otherwise."""

    endpoint: str | None = None  # OTLP/HTTP base URL (/v1/traces is appended); unset: the OTEL_ variables
    headers: dict[str, SecretStr] = Field(default_factory=dict)  # e.g. Authorization; unset: OTEL_EXPORTER_OTLP_HEADERS
    service_name: str = "flywheel"  # resource service.name, unless OTEL_SERVICE_NAME is set
    timeout_s: float = Field(default=10.0, gt=0)  # one export request, retries included
    queue_size: int = Field(default=2048, ge=1)  # spans waiting for export; beyond it they are dropped and counted
    batch_size: int = Field(default=512, ge=1)  # spans per export request
    export_every_s: float = Field(default=2.0, gt=0)  # how often the queue is exported
    capture_content: bool = False  # gen_ai.input/output.messages: the stored (redacted) conversation text


class TrackingConfig(BaseModel):
    """Experiment tracking of training rounds, gate results and reward per version (docs/observability.md)."""

    report_to: list[Literal["wandb"]] = Field(default_factory=list)  # empty: off
    project: str = "flywheel"
    entity: str | None = None  # the W&B team or user; unset: the key's default
    mode: Literal["online", "offline"] | None = None  # unset: WANDB_MODE, else W&B's default (online)
    dir: Path | None = None  # where run files go; unset: <data_dir>/tracking
    queue_size: int = Field(default=1000, ge=1)  # events waiting for the tracking thread; beyond it: dropped


class ReplicasConfig(BaseModel):
    """Several gateway replicas on one PostgreSQL store (docs/deploy.md): one runs the loop, every one follows it."""

    follow_s: float = Field(default=5.0, gt=0, le=300)  # how often a replica reads which version serves (and canaries)
    campaign_s: float = Field(default=2.0, gt=0, le=60)  # how often a follower tries to take the loop over
    # A replaced adapter is unloaded from a shared engine this long after the switch (other replicas may still
    # route to it until they follow); unset: 2 x follow_s + 30 s on a shared store, at once on DuckDB.
    retire_after_s: float | None = Field(default=None, ge=0)


def _default_engines() -> dict[str, EngineConfig]:
    return {"local": LocalEngineConfig()}


def _default_aliases() -> dict[str, AliasConfig]:
    return {"flywheel": AliasConfig(engine="local")}


class Settings(BaseSettings):
    """Everything the gateway reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", env_nested_delimiter="__",
                                      extra="forbid")

    data_dir: Path = Path("flywheel-data")  # everything the gateway writes lives here
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    max_body_bytes: int = 8 * 1024 * 1024  # larger requests get 413
    engines: dict[str, LocalEngineConfig | OpenAIEngineConfig] = Field(default_factory=_default_engines)
    aliases: dict[str, AliasConfig] = Field(default_factory=_default_aliases)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    groups: GroupsConfig = Field(default_factory=GroupsConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    rewards: RewardPolicy = Field(default_factory=RewardPolicy)
    train: TrainConfig = Field(default_factory=TrainConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)

    @property
    def database(self) -> str:
        return self.capture.database or str(self.data_dir / "flywheel.duckdb")

    @property
    def spool_path(self) -> Path:
        return self.capture.spool_path or self.data_dir / "spool" / "turns.jsonl"

    @field_validator("engines", mode="before")
    @classmethod
    def _engine_kind_default(cls, value: Any) -> Any:
        # An engine table without `kind` is local unless it names a base_url.
        if isinstance(value, dict):
            for cfg in value.values():
                if isinstance(cfg, dict) and "kind" not in cfg:
                    cfg["kind"] = "openai" if "base_url" in cfg else "local"
        return value

    @model_validator(mode="after")
    def _check_references(self) -> Settings:
        if self.routing.default is None and self.aliases:
            self.routing.default = next(iter(self.aliases))
        for name, alias in self.aliases.items():
            if alias.engine not in self.engines:
                raise ValueError(f"aliases.{name}.engine: unknown engine {alias.engine!r}")
        targets = list(self.routing.routes.values())
        if self.routing.default:
            targets.append(self.routing.default)
        for target in targets:
            if target not in self.aliases:
                raise ValueError(f"routing: route target {target!r} is not an alias")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_file`` (TOML) + environment + ``overrides``."""
    if config_file is None:
        return Settings(**overrides)
    if not config_file.is_file():
        raise FileNotFoundError(f"config file not found: {config_file}")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=config_file)

    return FileSettings(**overrides)
