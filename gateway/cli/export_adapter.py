"""``flywheel export-adapter``: one version of an alias, out of Flywheel, with a model card.

Examples::

    flywheel export-adapter --alias my-agent --version 7 --out ./my-agent-v7            # the PEFT adapter
    flywheel export-adapter --alias my-agent --version 7 --out ./my-agent-v7 --merged   # base + adapter, merged

The version's row (path, base model, training metrics, gate results) and its rewards come from
the running gateway's admin API, or from the store when no gateway runs (as ``flywheel versions``).
The adapter directory is copied as it is (``adapter_config.json``, the weights); ``--merged``
loads the base model, applies the adapter and folds it in (PEFT's ``merge_and_unload``), and saves
a plain transformers model with the base's tokenizer (``[train]`` installs torch and peft). Either
way ``README.md`` (a model card: base model, version history, training metrics, rewards, gate
results) and ``flywheel_version.json`` (the version's row as stored) are written beside it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from flywheel.gateway.cli.common import (
    AdminKeyOption,
    ConfigOption,
    DatabaseOption,
    DataDirOption,
    GatewayOption,
    Location,
    Target,
    admin_call,
    fail,
    locate,
    open_store,
)


def export_adapter(
        alias: Annotated[str, typer.Option("--alias", help="The alias whose version to export.")],
        version: Annotated[int, typer.Option("--version", min=1, help="The version number (flywheel versions).")],
        out: Annotated[Path, typer.Option("--out", help="Directory to write (new or empty).")],
        merged: Annotated[bool, typer.Option("--merged", help="Merge the adapter into the base model's weights.")]
        = False,
        base_model: Annotated[str | None, typer.Option(
            "--base-model", help="Base weights for --merged (default: the base model the version was trained on).")]
        = None,
        config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
        data_dir: DataDirOption = None, database: DatabaseOption = None) -> None:
    """Write a version's PEFT adapter (or, --merged, the base model with it merged in) and a model card.

    Example: flywheel export-adapter --alias my-agent --version 7 --out ./my-agent-v7 --merged
    """
    location = locate(Target(config, gateway, admin_key, data_dir, database))
    rows, rewards = _version_rows(location, alias)
    row = next((r for r in rows if r["version"] == version), None)
    if row is None:
        fail(f"{alias} has no version {version} (it has {', '.join(str(r['version']) for r in rows) or 'none'})")
    if out.exists() and any(out.iterdir()):
        fail(f"--out {out} is not empty")
    base = base_model or row["base_model"]
    with tempfile.TemporaryDirectory(prefix="flywheel-export-") as scratch:
        adapter = _readable_adapter(location, alias, row, Path(scratch))
        if merged:
            _merge(base, adapter, out)
        else:
            shutil.copytree(adapter, out, dirs_exist_ok=True)
    (out / "flywheel_version.json").write_text(json.dumps(row, indent=2) + "\n")
    (out / "README.md").write_text(model_card(alias, row, rewards, base, merged))
    typer.echo(f"version {version} of {alias} written to {out} ({'merged into ' + base if merged else 'PEFT adapter'})")


def _readable_adapter(location: Location, alias: str, row: dict[str, Any], scratch: Path) -> Path:
    """The version's directory when this machine sees it, else its files downloaded from the gateway."""
    from flywheel.gateway.training.rounds import AdminApi, RoundError

    adapter = Path(row["path"])
    if (adapter / "adapter_config.json").is_file():
        return adapter
    if location.url is None:
        fail(f"version {row['version']} of {alias} has no PEFT adapter at {adapter} ({row['status']}; "
             "adapter_config.json missing)")
    try:
        return AdminApi(location.url, location.admin_key).download(alias, row["version"], scratch / "adapter")
    except RoundError as exc:
        fail(f"version {row['version']} of {alias}: {exc}")


def _version_rows(location: Location, alias: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every version of the alias, and its reward per version, from the gateway or the store."""
    if location.url is not None:
        rows = admin_call(location, "GET", f"/flywheel/v1/aliases/{alias}/versions")["data"]
        status = admin_call(location, "GET", "/flywheel/v1/status")["aliases"]
        entry: dict[str, Any] = next((e for e in status if e["alias"] == alias), {})
        return rows, entry.get("reward_by_version") or {}
    from flywheel.gateway.storeproc import store_ops

    store = open_store(location.database or location.settings.database)
    try:
        return ([row.model_dump(mode="json") for row in store_ops.list_versions(store, location.settings, alias)],
                store_ops.reward_by_version(store, location.settings, alias).model_dump(exclude_none=True))
    finally:
        store.close()


def _merge(base: str, adapter: Path, out: Path) -> None:
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        fail("--merged needs torch, transformers and peft: pip install 'flywheel-rl[train]'")
    try:
        model = AutoModelForCausalLM.from_pretrained(base)
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as exc:
        fail(f"cannot load the base model {base} ({str(exc).splitlines()[0]}); name it with --base-model")
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def model_card(alias: str, row: dict[str, Any], rewards: dict[str, Any], base: str, merged: bool) -> str:
    """A Hugging Face style model card (YAML front matter, then Markdown) for one version."""
    version = row["version"]
    lines = ["---", f"base_model: {json.dumps(base)}"]
    lines += ["library_name: transformers", "tags: [flywheel, grpo]"] if merged else \
        ["library_name: peft", "tags: [flywheel, grpo, lora]"]
    lines += ["---", "", f"# {alias}, version {version}", "",
              ("The base model with the LoRA adapter merged into its weights." if merged else
               "A LoRA adapter (PEFT)."), "Exported by `flywheel export-adapter` from Flywheel's store.", "",
              "| | |", "|---|---|",
              f"| base model | `{base}` |", f"| status | {row['status']} |", f"| source | {row['source']} |",
              f"| trained from | {'version ' + str(row['parent_version']) if row.get('parent_version') else 'base'} |",
              f"| created | {row.get('created_at') or '-'} |", f"| promoted | {row.get('promoted_at') or '-'} |",
              f"| decision | {row.get('reason') or '-'} |", ""]
    metrics = row.get("metrics") or {}
    lines += ["## Training metrics", ""]
    lines += ["| metric | value |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items()))] \
        if metrics else ["None recorded (not trained by Flywheel's loop)."]
    lines += ["", "## Rewards", "", "Mean reward of the conversations each version served (95% interval).", ""]
    per_version = rewards.get("versions") or {}
    if per_version:
        lines += ["| version | mean | n | 95% interval |", "|---|---|---|---|"]
        for number, cell in per_version.items():
            interval = f"[{_fmt(cell['low'])}, {_fmt(cell['high'])}]" if "low" in cell else "-"
            mark = " (this one)" if str(number) == str(version) else ""
            lines.append(f"| {number}{mark} | {_fmt(cell['mean'])} | {cell['n']} | {interval} |")
    else:
        lines.append("No rewarded conversations yet.")
    gate = row.get("gate") or {}
    lines += ["", "## Gate results", ""]
    if gate:
        for stage in sorted(gate):
            lines += [f"### {stage}", "", "```json", json.dumps(gate[stage], indent=2, sort_keys=True), "```", ""]
    else:
        lines.append("None recorded (promoted by hand, or not gated yet).")
    return "\n".join(lines).rstrip() + "\n"
