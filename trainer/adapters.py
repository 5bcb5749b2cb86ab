"""Adapter versions on disk and in the store.

    from trainer import adapters
    out_dir = adapters.alias_dir(data_dir, "my-agent") / str(version)   # N: reserved in the store first
    result = train_round(base, groups, args, init_adapter=..., out_dir=out_dir, optimizer_state=...)
    with store.session() as session:
        adapters.record_round(session, result, alias="my-agent", version=version, base_model=base)

Layout of one version (``<data>/adapters/<alias>/<N>/``)::

    adapter_config.json          PEFT LoRA config   } what PeftModel.from_pretrained, the local engine's
    adapter_model.safetensors    LoRA weights       } load_adapter and vLLM (--lora-modules, /v1/load_lora_adapter) read
    flywheel_round.json          full resolved config, data provenance (group and trajectory ids, counts,
                                 what was skipped and why), metrics per round and per step, library versions
    optimizer.pt                 optimizer state (AdamW moments + parameter names): the next round of this alias
                                 continues from it when it trains from this version

Version numbers come from the store (``adapter_versions``, ``gateway/storeproc/versions.py``): it
hands each number out once, also after a failed round, so an engine name ``alias@N`` always
means one adapter (which avoids vLLM's stale-prefix-cache bugs on same-name reloads). A round
writes into a hidden sibling ``.N.partial-*`` and renames it over ``<N>/`` at the end, so
``<N>/`` is absent, empty (the round failed) or complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlmodel import Session

    from flywheel.capture.models import AdapterVersion, TrainingRun
    from flywheel.trainer.grpo_args import RoundResult

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ROUND_FILE = "flywheel_round.json"
OPTIMIZER_FILE = "optimizer.pt"
# Every file a version holds: the only names an archive may carry (optimizer.pt is read with weights_only=True)
VERSION_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ROUND_FILE, OPTIMIZER_FILE)
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class AdapterError(Exception):
    """An adapter directory is missing, incomplete, or not loadable where it must be."""


def alias_dir(data_dir: str | Path, alias: str) -> Path:
    """``<data>/adapters/<alias>``; the alias must be a plain name (no path separators)."""
    if not _ALIAS.match(alias):
        raise ValueError(f"alias {alias!r} is not a plain name ([A-Za-z0-9._-], starting alphanumeric)")
    return Path(data_dir) / "adapters" / alias


def is_complete(path: str | Path) -> bool:
    """True when ``path`` holds a loadable PEFT adapter (config + weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def optimizer_state_of(path: str | Path | None) -> Path | None:
    """The optimizer state saved beside an adapter version, if any (pass it to ``train_round``)."""
    if path is None:
        return None
    candidate = Path(path) / OPTIMIZER_FILE
    return candidate if candidate.is_file() else None


# --------------------------------------------------------------------------- writing a version


def staging_dir(out_dir: str | Path) -> Path:
    """A fresh hidden sibling of ``out_dir`` to write into before ``publish``."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def write_lora(policy: Any, directory: Path) -> None:
    """What PEFT's ``policy.save_pretrained(directory, selected_adapters=["default"])`` writes, but its model card:
    PEFT renders one from a template on every save (about half the save on the tiny model), and a version keeps
    none. An adapter without a task type or a base model name (PEFT fills those in) goes through PEFT itself."""
    config = policy.peft_config["default"]
    if config.task_type is None or config.base_model_name_or_path is None:
        policy.save_pretrained(directory, selected_adapters=["default"])
        (directory / "README.md").unlink(missing_ok=True)
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    weights = get_peft_model_state_dict(policy, adapter_name="default")
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    inference_mode, config.inference_mode = config.inference_mode, True
    try:
        config.save_pretrained(str(directory))
    finally:
        config.inference_mode = inference_mode


def write_round_file(directory: str | Path, record: dict[str, Any]) -> Path:
    """Write ``flywheel_round.json`` (config + provenance + metrics), nanoGPT's self-describing checkpoint."""
    path = Path(directory) / ROUND_FILE
    path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_round_file(directory: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(directory) / ROUND_FILE).read_text())
    return data


def publish(staging: str | Path, out_dir: str | Path) -> Path:
    """Move a finished ``staging`` directory to ``out_dir`` (absent or empty) in one rename."""
    staging, out = Path(staging), Path(out_dir)
    if not is_complete(staging):
        raise AdapterError(f"{staging} holds no complete PEFT adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    if out.is_dir() and any(out.iterdir()):
        raise AdapterError(f"{out} already holds files: adapter versions are never overwritten")
    if out.is_dir():
        out.rmdir()  # rename(2) would replace an empty directory too, but not on every platform
    os.replace(staging, out)
    return out


def pack(directory: str | Path, out: IO[bytes]) -> list[str]:
    """Write a version's files to ``out`` as an uncompressed tar (safetensors do not compress); the names written."""
    names = [name for name in VERSION_FILES if (Path(directory) / name).is_file()]
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for name in names:
            tar.add(Path(directory) / name, arcname=name, recursive=False)
    return names


def unpack(archive: IO[bytes], out_dir: str | Path) -> list[str]:
    """Extract a version archive (``pack``'s output) into ``out_dir`` (absent or empty) through a staging sibling.

    Only ``VERSION_FILES``, each once and as a regular file: no paths, links or other names, so an archive
    cannot write anywhere else or bring code. Raises :class:`AdapterError` naming what is wrong.
    """
    staging = staging_dir(out_dir)
    try:
        names: list[str] = []
        with tarfile.open(fileobj=archive, mode="r|") as tar:
            for member in tar:
                if member.name not in VERSION_FILES or not member.isfile() or member.name in names:
                    raise AdapterError(f"archive member {member.name!r} is not allowed: a version archive holds "
                                       f"each of {', '.join(VERSION_FILES)} at most once, as plain files")
                source = tar.extractfile(member)
                assert source is not None  # a regular file always has a reader
                with (staging / member.name).open("wb") as target:
                    shutil.copyfileobj(source, target)
                names.append(member.name)
        _check_lora_config(staging / ADAPTER_CONFIG)
        publish(staging, out_dir)
        return names
    except tarfile.TarError as exc:
        raise AdapterError(f"not a tar archive of an adapter version: {exc}") from None
    finally:
        discard(staging)


def _check_lora_config(path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} is missing or not JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{ADAPTER_CONFIG} is not a PEFT LoRA config (peft_type must be \"LORA\")")


def discard(path: str | Path) -> None:
    """Remove a staging directory (or a reserved, still empty version directory)."""
    path = Path(path)
    if path.name.startswith(".") or (path.is_dir() and not any(path.iterdir())):
        shutil.rmtree(path, ignore_errors=True)


def check_vllm_compatible(path: str | Path, *, max_lora_rank: int = 16) -> None:
    """Raise ``AdapterError`` for what vLLM's LoRA loader (``vllm/lora/peft_helper.py``) rejects.

    vLLM reads ``adapter_config.json`` (unknown keys ignored) and refuses: ``modules_to_save``,
    DoRA, LoRA bias, ``bias != "none"``, PiSSA/OLoRA-style inits that change base weights,
    layer replication, and ranks above the server's ``--max-lora-rank`` (default 16).
    """
    config_path = Path(path) / ADAPTER_CONFIG
    if not is_complete(path):
        raise AdapterError(f"{path} holds no complete PEFT adapter")
    config = json.loads(config_path.read_text())
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
    if not config.get("target_modules"):
        problems.append("target_modules is empty")
    if config.get("modules_to_save"):
        problems.append("modules_to_save must be empty")
    if config.get("use_dora"):
        problems.append("DoRA is not supported")
    if config.get("lora_bias") or config.get("bias", "none") != "none":
        problems.append("LoRA bias is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        problems.append(f"init_lora_weights={init!r} changes base weights")
    if config.get("layer_replication"):
        problems.append("layer_replication is not supported")
    rank = max([int(config.get("r", 0)), *[int(r) for r in (config.get("rank_pattern") or {}).values()]])
    if rank > max_lora_rank:
        problems.append(f"rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    if problems:
        raise AdapterError(f"{path}: vLLM would refuse this adapter: {'; '.join(problems)}")


# --------------------------------------------------------------------------- the store


def record_round(session: Session, result: RoundResult, *, alias: str, base_model: str,
                 version: int | None = None, parent_version: int | None = None, run_id: str | None = None,
                 reserved: AdapterVersion | None = None,
                 commit: bool = True) -> tuple[TrainingRun, AdapterVersion | None]:
    """Write the ``training_runs`` row (and the ``adapter_versions`` row when an adapter was made).

    ``run_id`` names a run row created earlier (status ``running``) to finish; otherwise a new
    row is added. ``reserved`` is the version's row when the caller has read it already. The adapter
    row starts as ``candidate``: promotion is the gateway's business.
    """
    from sqlmodel import select

    from flywheel.capture.models import AdapterVersion, TrainingRun
    from flywheel.capture.turns import new_id

    adapter = None
    if result.adapter_dir is not None:
        if version is None:
            version = int(Path(result.adapter_dir).name)
        # The number was reserved before the round (the store hands out versions); fill that row in. Read before
        # the run row is added, which is then written once, whole (a read flushes what the session holds).
        adapter = reserved or session.exec(select(AdapterVersion).where(AdapterVersion.alias == alias,
                                                                        AdapterVersion.version == version)).first()
        if adapter is None:
            adapter = AdapterVersion(id=new_id("adv"), alias=alias, version=version, path=str(result.adapter_dir),
                                     base_model=base_model)
    run = session.get(TrainingRun, run_id) if run_id else None
    if run is None:
        run = TrainingRun(id=run_id or new_id("run"), alias=alias, started_at=result.started_at)
        session.add(run)
    run.status = result.status
    run.finished_at = result.finished_at
    run.config = result.config
    run.group_ids = result.group_ids
    run.metrics = result.metrics
    run.error = None
    if adapter is not None:
        adapter.path, adapter.base_model, adapter.parent_version = str(result.adapter_dir), base_model, parent_version
        adapter.training_run_id, adapter.status, adapter.metrics = run.id, "candidate", result.metrics
        session.add(adapter)
        run.adapter_version_id = adapter.id
    if commit:
        session.commit()
    return run, adapter


def record_failure(session: Session, *, alias: str, error: str, run_id: str | None = None,
                   config: dict[str, Any] | None = None, group_ids: list[str] | None = None,
                   commit: bool = True) -> TrainingRun:
    """Mark a run ``failed`` with its error (creating the row if ``run_id`` is unknown)."""
    from flywheel.capture.models import TrainingRun, utcnow
    from flywheel.capture.turns import new_id

    run = session.get(TrainingRun, run_id) if run_id else None
    if run is None:
        run = TrainingRun(id=run_id or new_id("run"), alias=alias, config=config, group_ids=group_ids)
        session.add(run)
    run.status = "failed"
    run.finished_at = utcnow()
    run.error = error
    if commit:
        session.commit()
    return run
