"""Gateway configuration: one TOML file plus ``FLYWHEEL_*`` environment variables.

Precedence (highest first): constructor arguments, environment variables
(``FLYWHEEL_PORT=9000``, nested with ``__``: ``FLYWHEEL_AUTH__ADMIN_KEY=...``), the TOML
file, the embedded defaults below. With nothing given, the gateway serves the tiny
model built into ``<data_dir>/models/tiny`` through the local engine, and routes every
model name to the alias ``flywheel``. ``deploy/flywheel.example.toml`` is the annotated
reference.

Every value is validated when it is read, and every ``FLYWHEEL_*`` variable must name a
setting (:func:`unknown_variables`): a misspelled one is an error naming the close match,
never silently ignored. Environment variables change or add entries of the ``[engines]``
and ``[aliases]`` tables (the file's, else the embedded defaults); they never replace a
table. What needs the file system or the network (model directories, a writable data
directory, the upstream's model name) is checked by ``flywheel serve`` before it starts
(``gateway/cli/preflight.py``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, Field, SecretStr, StringConstraints, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from flywheel.gateway.core.config_env import unknown_variables
from flywheel.judge.rewards import RewardPolicy
from flywheel.judge.ruler import JudgeConfig

TINY_MODEL = "tiny"  # the model name that means "the tiny model built offline into the data dir"
MAX_VERSION = 2**31 - 1  # adapter version numbers are stored as 32-bit integers



def _non_empty_secret(key: SecretStr) -> SecretStr:
    if not key.get_secret_value().strip():
        raise ValueError("a key must not be empty")
    return key


# Alias names become URL path segments (/aliases/{alias}/...) and directories (<data_dir>/adapters/<alias>).
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Secret = Annotated[SecretStr, AfterValidator(_non_empty_secret)]
# An adapter version wherever one is taken (the API, the CLI): 0 is the base model; JSON true or 1.5 is not one.
AdapterVersion = Annotated[int, Field(ge=0, le=MAX_VERSION, strict=True)]


def _json_or_text(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


class LocalEngineConfig(BaseModel):
    """In-process transformers + peft engine (development, tests, small deployments)."""

    kind: Literal["local"] = "local"
    model: str = Field(default=TINY_MODEL, min_length=1)  # "tiny", a model directory, or an HF id in the HF cache
    device: str = Field(default="auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")  # "auto": cuda when available
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # "auto": bfloat16 on GPU, float32 on CPU
    default_max_tokens: int = Field(default=256, ge=1)  # a request without max_tokens or max_completion_tokens
    max_batch_n: int = Field(default=16, ge=1)  # largest n one request may ask for
    # Decode threads; 0: all cores but loop.train_threads (at least 1): a step split onto the child's core waits
    threads: int = Field(default=0, ge=0)


class OpenAIEngineConfig(BaseModel):
    """Any OpenAI-compatible upstream (vLLM with --enable-lora in production)."""

    kind: Literal["openai"] = "openai"
    base_url: Annotated[str, AfterValidator(_http_url)]  # e.g. http://127.0.0.1:8001/v1
    api_key: Secret | None = None  # sent upstream as a Bearer token; never logged
    timeout_s: float = Field(default=600.0, gt=0)  # read timeout: longest silence tolerated between bytes
    connect_timeout_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=512, ge=1)
    request_token_ids: bool = True  # ask vLLM for return_token_ids + logprobs (stripped for clients)
    # Each vLLM server behind a load-balancing base_url: vLLM's runtime LoRA API acts on the one server it reaches
    replica_urls: list[Annotated[str, AfterValidator(_http_url)]] = Field(default_factory=list)


EngineConfig = LocalEngineConfig | OpenAIEngineConfig


class AliasConfig(BaseModel):
    """A served model name: which engine, which base model, which adapter."""

    engine: str = "local"  # a key of [engines]
    # Default: the local engine's model, or the one model an upstream's /v1/models lists (several or none: error)
    base_model: str | None = Field(default=None, min_length=1)
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

    api_keys: list[Secret] = Field(default_factory=list)
    admin_key: Secret | None = None  # unset: admin API answers loopback clients only
    # Says a keyless server on a non-loopback host is meant: `flywheel serve` refuses one otherwise (docs/security.md)
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _admin_key_is_not_a_client_key(self) -> AuthConfig:
        admin = self.admin_key.get_secret_value() if self.admin_key else None
        if admin is not None and any(key.get_secret_value() == admin for key in self.api_keys):
            raise ValueError("auth.admin_key is also a client key: every client would be an admin")
        return self


class RedactionConfig(BaseModel):
    """What is scrubbed from captured text before it is written anywhere."""

    builtin: bool = True  # e-mail addresses, phone numbers, card-like numbers, API-key-like tokens
    patterns: list[str] = Field(default_factory=list)  # extra regexes; matches become [REDACTED:CUSTOM_i]

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for index, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"patterns[{index}] is not a valid regular expression ({exc}): {pattern!r}") from None
            if re.fullmatch(pattern, ""):
                raise ValueError(f"patterns[{index}] matches the empty string, so it would match everywhere: "
                                 f"{pattern!r}")
        return patterns


class CaptureConfig(BaseModel):
    """Recording traffic as trajectories (architecture §4, §8)."""

    enabled: bool = True  # default for requests without an X-Flywheel-Capture header
    sample_rate: float = Field(default=1.0, ge=0, le=1)  # fraction of (enabled) requests captured
    database: str | None = Field(default=None, min_length=1)  # unset: <data_dir>/flywheel.duckdb; or a URL
    spool_path: Path | None = None  # unset: <data_dir>/spool/turns.jsonl
    idle_close_s: float = Field(default=600.0, gt=0)  # a trajectory with no new turn for this long is closed
    queue_size: int = Field(default=10_000, ge=1)  # turns waiting for the writer; beyond it they go to the spool
    batch_size: int = Field(default=1024, ge=1)  # turns per store transaction
    # Longest wait to fill a batch, which a reader needing the latest turns cuts short (docs/capture.md)
    batch_wait_s: float = Field(default=1.0, gt=0)
    # Answers go to the store process in one write this often: each write wakes it, a gateway crash loses this much
    handoff_s: float = Field(default=0.05, gt=0, le=1)
    retry_s: float = Field(default=2.0, gt=0)  # how often the spool is retried while the store refuses writes
    # Store process niceness (0: the gateway's): requests get the cores first, capture catches up in the gaps
    store_nice: int = Field(default=10, ge=0, le=19)
    # DuckDB's memory limit: its default, 80% of RAM, is a database server's share, not a sidecar's ("Soak")
    store_memory_mb: int = Field(default=512, ge=64)
    redaction: RedactionConfig = Field(default_factory=RedactionConfig)
    # A turn waits this long for a parent another replica may still be writing; unset: 5 s shared, 0 on DuckDB
    link_wait_s: float | None = Field(default=None, ge=0, le=300)


class GroupsConfig(BaseModel):
    """Where GRPO groups come from (architecture §5)."""

    min_size: int = Field(default=2, ge=2)  # smaller groups wait for members (or are dropped: forks)
    max_size: int = Field(default=8, ge=2)  # larger ones are cut, oldest first; never padded
    task_window_s: float = Field(default=3600.0, gt=0)  # same-task trajectories must start within this span
    cohorts: bool = False  # also group by system prompt + tools alone (weaker signal)
    fork_fraction: float = Field(default=0.0, ge=0, le=1)  # share of captured chat turns forked
    fork_k: int = Field(default=3, ge=1, le=16)  # extra samples per forked turn
    # "first": fork_fraction forks only a conversation's first turn (no assistant message yet), where an agent
    # whose later turns follow from its first decides; "untied": each turn position at the share of its recent
    # fork groups that did not tie (gateway/serving/fork_yield.py); X-Flywheel-Fork forks any turn either way
    fork_turns: Literal["all", "first", "untied"] = "all"
    # "head": the siblings come from the training line's head, so a round learns from the policy it trains
    fork_from: Literal["serving", "head"] = "serving"
    # "without_replacement": the siblings are distinct, drawn by stochastic beam search where the engine can
    fork_draw: Literal["independent", "without_replacement"] = "independent"
    form_every_s: float = Field(default=60.0, gt=0)  # how often closed trajectories are grouped

    @model_validator(mode="after")
    def _sizes_in_order(self) -> GroupsConfig:
        if self.min_size > self.max_size:
            raise ValueError(f"groups.min_size ({self.min_size}) is larger than groups.max_size ({self.max_size})")
        return self


class TrainConfig(BaseModel):
    """``flywheel train``: GRPO settings (trainer/grpo_args.py: GRPOArgs) and batch size."""

    args: dict[str, Any] = Field(default_factory=dict)  # GRPOArgs fields, e.g. {learning_rate = 1e-5, max_steps = 8}
    tiny_defaults: bool = True  # training the built-in tiny model starts from GRPOArgs.tiny() (lr 1e-2, r 16)
    max_groups: int = Field(default=64, ge=1)  # scored groups per round
    # true: trainer workers train the rounds through the admin API, so the gateway needs no torch (docs/deploy.md)
    workers: bool = False
    # The largest version (adapter + optimizer state) a worker on another machine may upload to the admin API
    max_upload_mb: int = Field(default=4096, ge=1)
    # Which groups a round takes beyond max_groups: the newest, sampled nearest the trained policy (ratio near 1)
    batch_order: Literal["newest", "oldest"] = "newest"

    @field_validator("args", mode="before")
    @classmethod
    def _typed_values(cls, args: Any) -> Any:
        # An environment variable (FLYWHEEL_TRAIN__ARGS__LEARNING_RATE=1e-5) arrives as text: read it as JSON.
        return {key: _json_or_text(value) for key, value in args.items()} if isinstance(args, dict) else args


class GateConfig(BaseModel):
    """The offline promotion gate: held-out contexts answered by the candidate and the serving version."""

    offline: bool = True  # off: candidates go straight to the canary (or are promoted when that is off too)
    contexts: int = Field(default=32, ge=1)  # M recent held-out contexts per candidate
    min_contexts: int = Field(default=8, ge=1)  # fewer held out so far: the candidate waits for more traffic
    holdout_fraction: float = Field(default=0.1, ge=0, le=0.5)  # of ungrouped trajectories; never trained on
    win_rate: float = Field(default=0.5, ge=0, le=1)  # pass when (wins + ties / 2) / M reaches this
    fail_alpha: float = Field(default=0.05, gt=0, le=1)  # under win_rate: failed at sign-test p <= this
    reward_hook: str | None = None  # "module:function" or an http(s) URL; unset: [judge] reward_hook, else RULER
    max_tokens: int = Field(default=256, ge=1)  # per answer
    temperature: float = Field(default=0.0, ge=0, le=2)  # 0: greedy, the versions' most likely answers


class CanaryConfig(BaseModel):
    """The online gate: a share of live conversations on the candidate, compared by a sequential test."""

    enabled: bool = True
    fraction: float = Field(default=0.1, gt=0, lt=1)  # of new conversations; sticky per conversation
    alpha: float = Field(default=0.05, gt=0, lt=1)  # bound on false promotions (and on false rejections)
    margin: float = Field(default=0.0, ge=0)  # > 0: promote when not worse than the serving version by this
    max_pairs: int = Field(default=2000, ge=1)  # stop here; the decision is on_max
    # How long a reward waits for one of the other arm in its context; then, if its context was seen once, it is
    # paired in arrival order (inf: same-context pairs only). docs/loop.md, "the canary's pairs".
    pair_wait_s: float = Field(default=600.0, ge=0)
    # The smallest gain worth a swap: a candidate shown to gain less is rejected by the test (None: never).
    min_gain: float | None = Field(default=None, gt=0)
    on_max: Literal["reject", "promote"] = "reject"  # nothing was shown by max_pairs
    # Undecided after this many pairs while a newer candidate waits: that one takes the canary (None: never).
    hand_over_pairs: int | None = Field(default=None, ge=1)
    reward_min: float = 0.0  # rewards are clipped to [reward_min, reward_max] for the test (it needs bounds)
    reward_max: float = 1.0

    @model_validator(mode="after")
    def _bounds_in_order(self) -> CanaryConfig:
        if self.reward_min >= self.reward_max:
            raise ValueError(f"loop.canary.reward_min ({self.reward_min}) must be below reward_max ({self.reward_max})")
        if self.min_gain is not None and self.min_gain >= self.reward_max - self.reward_min:
            raise ValueError(f"loop.canary.min_gain ({self.min_gain}) must be below the reward range "
                             f"({self.reward_max - self.reward_min})")
        return self


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


# The embedded [engines] and [aliases] tables: what serves when the file names none (see DefaultTables).
DEFAULT_ENGINES: dict[str, dict[str, Any]] = {"local": {"kind": "local"}}
DEFAULT_ALIASES: dict[str, dict[str, Any]] = {"flywheel": {"engine": "local"}}
ENV_PREFIX = "FLYWHEEL_"
# Read by the CLI, not settings: the admin key its commands send (serve's when none is configured), the client key
CLI_ADMIN_KEY_VARIABLE = "FLYWHEEL_ADMIN_KEY"
CLI_API_KEY_VARIABLE = "FLYWHEEL_API_KEY"
CLI_VARIABLES = frozenset({CLI_ADMIN_KEY_VARIABLE, CLI_API_KEY_VARIABLE})


class ReplicasConfig(BaseModel):
    """Several gateway replicas on one PostgreSQL store (docs/deploy.md): one runs the loop, every one follows it."""

    follow_s: float = Field(default=5.0, gt=0, le=300)  # how often a replica reads which version serves (and canaries)
    campaign_s: float = Field(default=2.0, gt=0, le=60)  # how often a follower tries to take the loop over
    # A replaced adapter stays loaded this long, for replicas that have not followed yet (default: docs/loop.md)
    retire_after_s: float | None = Field(default=None, ge=0)


def _default_engines() -> dict[str, EngineConfig]:
    return {name: LocalEngineConfig.model_validate(cfg) for name, cfg in DEFAULT_ENGINES.items()}


def _default_aliases() -> dict[str, AliasConfig]:
    return {name: AliasConfig.model_validate(cfg) for name, cfg in DEFAULT_ALIASES.items()}


class Settings(BaseSettings):
    """Everything the gateway reads at start-up."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid")

    data_dir: Path = Path("flywheel-data")  # everything the gateway writes lives here
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)  # larger requests get 413
    # Directories besides <data_dir>/adapters that the admin API may load adapters from (docs/security.md).
    adapter_dirs: list[Path] = Field(default_factory=list)
    engines: dict[Name, LocalEngineConfig | OpenAIEngineConfig] = Field(default_factory=_default_engines)
    aliases: dict[Name, AliasConfig] = Field(default_factory=_default_aliases)
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

    @property
    def adapters_dir(self) -> Path:
        """Where the gateway's own adapters live (a round writes ``<alias>/<version>`` here)."""
        return self.data_dir / "adapters"

    def allowed_adapter_path(self, path: str) -> Path:
        """``path`` resolved (symlinks and ``..``), when it lies inside the adapters directory or an
        ``adapter_dirs`` entry; ``ValueError`` saying so otherwise."""
        resolved = Path(path).expanduser().resolve()
        roots = [root.expanduser().resolve() for root in (self.adapters_dir, *self.adapter_dirs)]
        if not any(resolved.is_relative_to(root) for root in roots):
            raise ValueError(f"{resolved} is outside the directories adapters are loaded from "
                             f"({', '.join(map(str, roots))}; more through the adapter_dirs setting)")
        return resolved

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

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
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, deep_merge=True),
                DefaultTables(settings_cls))


class DefaultTables(PydanticBaseSettingsSource):
    """The embedded ``[engines]``/``[aliases]`` tables, under the environment, where file and arguments have none.

    So ``FLYWHEEL_ENGINES__UP__BASE_URL=...`` adds an engine to the defaults instead of replacing the
    table. The default ``local`` engine is left out when no alias uses it and nothing named it: it
    would load a model for nobody.
    """

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ builds the whole contribution

    def __call__(self) -> dict[str, Any]:
        given = {**self.settings_sources_data.get("TomlConfigSettingsSource", {}),
                 **self.settings_sources_data.get("InitSettingsSource", {})}
        state = self.current_state
        out: dict[str, Any] = {}
        if "aliases" not in given:
            out["aliases"] = DEFAULT_ALIASES
        if "engines" not in given:
            aliases = {**out.get("aliases", {}), **(state.get("aliases") or {})}
            used = {cfg.get("engine", "local") if isinstance(cfg, Mapping) else "local" for cfg in aliases.values()}
            named = state.get("engines") or {}
            out["engines"] = {name: cfg for name, cfg in DEFAULT_ENGINES.items() if name in used or name in named}
        return out


class SettingsError(ValueError):
    """The configuration cannot be used; the message says what to change (one line)."""


def load_settings(config_files: Path | Sequence[Path] | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_files`` (TOML, later files over earlier ones) + environment + ``overrides``.

    Several files are layered table by table: ``-c deploy/flywheel.small-model.toml -c mine.toml`` keeps
    the first file's ``[loop.gate]`` keys that the second does not set. A ``FLYWHEEL_*`` variable that
    names no setting is a :class:`SettingsError` naming the close match.
    """
    unknown = unknown_variables(Settings, ENV_PREFIX, os.environ, also_known=CLI_VARIABLES)
    if unknown:
        raise SettingsError("; ".join(unknown))
    files = [config_files] if isinstance(config_files, Path) else list(config_files or [])
    if not files:
        return Settings(**overrides)
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"config file not found: {file}")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=files)

    return FileSettings(**overrides)
