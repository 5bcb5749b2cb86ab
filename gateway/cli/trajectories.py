"""``flywheel trajectories``: list, show, export and delete captured trajectories.

Examples::

    flywheel trajectories list --status closed --since 1d
    flywheel trajectories show traj_0123abcd
    flywheel trajectories export --format openai --out train.jsonl --has-reward
    flywheel trajectories export --format parquet --out ./parquet
    flywheel trajectories delete --client-key-id key_0123456789ab --yes

Where the data comes from: ``gateway/cli/common.py`` (``locate``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol
from urllib.parse import quote

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flywheel.admin_client import AdminClient, AdminError
from flywheel.gateway.cli.common import (
    AdminKeyOption,
    AliasOption,
    ConfigOption,
    DatabaseOption,
    DataDirOption,
    GatewayOption,
    Target,
    admin_client,
    admin_failures,
    fail,
    locate,
    open_store,
)

if TYPE_CHECKING:
    from flywheel.capture.export import ParquetExport
    from flywheel.capture.store import Store

trajectories_app = typer.Typer(help="List, show, export and delete captured trajectories.", no_args_is_help=True)

SinceOption = Annotated[str | None, typer.Option(
    "--since", help="Created at or after: ISO 8601, unix seconds, or a duration ago (30m, 2h, 7d).")]
UntilOption = Annotated[str | None, typer.Option("--until", help="Created before (same forms as --since).")]
StatusOption = Annotated[str | None, typer.Option("--status", help="open or closed.")]
TaskOption = Annotated[str | None, typer.Option("--task", help="Only this task key.")]
RewardOption = Annotated[bool | None, typer.Option(
    "--has-reward/--no-reward", help="Only trajectories with (or without) a score or feedback.",
    show_default=False)]
ClientKeyOption = Annotated[str | None, typer.Option("--client-key-id", help="Only this client key id.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

_PAGE = 1000  # trajectories per request when walking a whole selection


def _console(stderr: bool = False) -> Console:
    """Rich output; wide when piped so tables do not wrap in files and tests (``COLUMNS`` wins)."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", "200"))
    return Console(file=stream, width=width, highlight=False)


# -- where the data comes from -------------------------------------------------------------------------------

class Backend(Protocol):
    """The admin operations, over HTTP or on the file; both speak the admin API's JSON shapes."""

    where: str

    def page(self, filters: dict[str, str], *, limit: int, after: str | None, order: str) -> dict[str, Any]: ...

    def detail(self, trajectory_id: str) -> dict[str, Any] | None: ...

    def delete(self, trajectory_id: str) -> dict[str, Any] | None: ...

    def delete_client(self, client_key_id: str) -> dict[str, Any]: ...

    def parquet(self, out_dir: Path, filters: dict[str, str], ids: list[str], progress: Progress) -> ParquetExport:
        ...


class ApiBackend:
    """A running gateway's admin API."""

    def __init__(self, client: AdminClient) -> None:
        self.client = client
        self.where = client.url

    def _call(self, method: str, path: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The answer; None for a trajectory the gateway does not have; any other failure is a CLI error."""
        with admin_failures():
            try:
                body: dict[str, Any] = self.client.call(method, "/flywheel/v1" + path, params=params)
            except AdminError as exc:
                if exc.status == 404 and exc.code == "not_found":
                    return None
                raise
        return body

    def page(self, filters: dict[str, str], *, limit: int, after: str | None, order: str) -> dict[str, Any]:
        params = {**filters, "limit": limit, "order": order, **({"after": after} if after else {})}
        found = self._call("GET", "/trajectories", params)
        assert found is not None
        return found

    def detail(self, trajectory_id: str) -> dict[str, Any] | None:
        return self._call("GET", f"/trajectories/{quote(trajectory_id, safe='')}")

    def delete(self, trajectory_id: str) -> dict[str, Any] | None:
        return self._call("DELETE", f"/trajectories/{quote(trajectory_id, safe='')}")

    def delete_client(self, client_key_id: str) -> dict[str, Any]:
        found = self._call("DELETE", "/trajectories", {"client_key_id": client_key_id})
        assert found is not None
        return found

    def parquet(self, out_dir: Path, filters: dict[str, str], ids: list[str], progress: Progress) -> ParquetExport:
        """The gateway holds the file: fetch the rows, load them into a scratch DuckDB file, COPY from there
        (the same schema, so the Parquet files match a direct export)."""
        from flywheel.capture.export import export_parquet, load_details
        from flywheel.capture.store import Store

        task = progress.add_task("fetching", total=len(ids))
        with tempfile.TemporaryDirectory(prefix="flywheel-export-") as scratch:
            store = Store(Path(scratch) / "export.duckdb")
            try:
                for trajectory_id in ids:
                    detail = self.detail(trajectory_id)
                    if detail is not None:  # deleted since it was listed
                        load_details(store, [detail])
                    progress.advance(task)
                return export_parquet(store, out_dir)
            finally:
                store.close()


class StoreBackend:
    """The store file, opened directly (no gateway may hold it)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        from flywheel.capture.store import printable_url

        self.where = printable_url(store.url)

    def page(self, filters: dict[str, str], *, limit: int, after: str | None, order: str) -> dict[str, Any]:
        from flywheel.capture import queries

        with _query_errors():
            flt = queries.TrajectoryFilter.from_query(filters)
            order_ = queries.parse_order(order)
            return queries.list_trajectories(self.store, flt, limit=limit, after=after, order=order_).to_json()

    def detail(self, trajectory_id: str) -> dict[str, Any] | None:
        from flywheel.capture import queries

        return queries.trajectory_detail(self.store, trajectory_id)

    def delete(self, trajectory_id: str) -> dict[str, Any] | None:
        from flywheel.capture import queries

        counts = queries.delete_trajectory(self.store, trajectory_id)
        if counts is None:
            return None
        return {"object": "trajectory.deleted", "id": trajectory_id, "deleted": True, "rows": counts.to_json()}

    def delete_client(self, client_key_id: str) -> dict[str, Any]:
        from flywheel.capture import queries

        counts = queries.delete_client_data(self.store, client_key_id)
        return {"object": "client_key.deleted", "client_key_id": client_key_id, "deleted": True,
                "rows": counts.to_json()}

    def parquet(self, out_dir: Path, filters: dict[str, str], ids: list[str], progress: Progress) -> ParquetExport:
        from flywheel.capture import queries
        from flywheel.capture.export import ExportError, export_parquet

        task = progress.add_task("copying", total=len(ids))
        with _query_errors():
            flt = queries.TrajectoryFilter.from_query(filters)
        try:
            result = export_parquet(self.store, out_dir, flt)
        except ExportError as exc:
            fail(str(exc))
        progress.update(task, completed=len(ids))
        return result


@contextmanager
def _query_errors() -> Iterator[None]:
    from flywheel.capture.queries import QueryError

    try:
        yield
    except QueryError as exc:
        fail(str(exc))


@contextmanager
def connect(target: Target) -> Iterator[Backend]:
    """A backend for the trajectory commands, over the located gateway or file."""
    location = locate(target)
    if location.url is not None:
        with admin_client(location, timeout_s=60.0) as client:
            yield ApiBackend(client)
        return
    store = open_store(location.database or location.settings.database)
    try:
        yield StoreBackend(store)
    finally:
        store.close()


def _filters(alias: str | None, since: str | None, until: str | None, status: str | None, task: str | None,
             has_reward: bool | None, client_key_id: str | None) -> dict[str, str]:
    """The admin API's query parameters (the file backend parses the same ones)."""
    given = {"alias": alias, "since": since, "until": until, "status": status, "task": task,
             "client_key_id": client_key_id,
             "has_reward": None if has_reward is None else str(has_reward).lower()}
    return {k: v for k, v in given.items() if v is not None}


def _all_ids(backend: Backend, filters: dict[str, str]) -> list[str]:
    """Every matching trajectory id, oldest first, page by page."""
    ids: list[str] = []
    after = None
    while True:
        page = backend.page(filters, limit=_PAGE, after=after, order="asc")
        ids += [t["id"] for t in page["data"]]
        if not page["has_more"] or not page["data"]:
            return ids
        after = page["last_id"]


# -- commands -------------------------------------------------------------------------------------------------

def _when(text: str | None) -> str:
    return datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M:%S") if text else "-"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


@trajectories_app.command("list")
def list_command(config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
                 data_dir: DataDirOption = None, database: DatabaseOption = None, alias: AliasOption = None,
                 since: SinceOption = None, until: UntilOption = None, status: StatusOption = None,
                 task: TaskOption = None, has_reward: RewardOption = None, client_key_id: ClientKeyOption = None,
                 limit: Annotated[int, typer.Option(help="At most this many.", min=1, max=1000)] = 50,
                 after: Annotated[str | None, typer.Option(help="Continue after this trajectory id.")] = None,
                 as_json: JsonOption = False) -> None:
    """List trajectories, newest first.

    Example: flywheel trajectories list --alias my-agent --status closed --since 1d
    """
    filters = _filters(alias, since, until, status, task, has_reward, client_key_id)
    with connect(Target(config, gateway, admin_key, data_dir, database)) as backend:
        page = backend.page(filters, limit=limit, after=after, order="desc")
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("ID", overflow="fold")  # ids are copied from here: fold a long one, never cut it
    for name in ("ALIAS", "STATUS", "TURNS", "BRANCHES", "REWARD", "CREATED (UTC)"):
        table.add_column(name, justify="right" if name in ("TURNS", "BRANCHES", "REWARD") else "left")
    for t in page["data"]:
        table.add_row(t["id"], t["alias"], t["status"], str(t["turn_count"]), str(t["branch_count"]),
                      _reward(t["reward"]), _when(t["created_at"]))
    console = _console()
    console.print(table)
    console.print(_count(len(page["data"]), "trajectory", "trajectories")
                  + (f"; more with --after {page['last_id']}" if page["has_more"] else ""))


@trajectories_app.command("show")
def show_command(trajectory_id: Annotated[str, typer.Argument(help="The trajectory's id.")],
                 config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
                 data_dir: DataDirOption = None, database: DatabaseOption = None,
                 as_json: JsonOption = False) -> None:
    """Show one trajectory: its facts, its turns in order, its branches.

    Example: flywheel trajectories show traj_0123abcd --json
    """
    with connect(Target(config, gateway, admin_key, data_dir, database)) as backend:
        detail = backend.detail(trajectory_id)
    if detail is None:
        fail(f"no trajectory {trajectory_id!r}")
    if as_json:
        typer.echo(json.dumps(detail, indent=2))
        return
    console = _console()
    console.print(f"trajectory {detail['id']}")
    for label, value in (("alias", detail["alias"]), ("status", detail["status"]),
                         ("created", _when(detail["created_at"])), ("updated", _when(detail["updated_at"])),
                         ("closed", _when(detail["closed_at"]) + (f" ({detail['close_reason']})"
                                                                  if detail["close_reason"] else "")),
                         ("client key", detail["client_key_id"] or "-"), ("task", detail["task_key"] or "-"),
                         ("group", detail["group_key"] or "-"), ("reward", _reward(detail["reward"]))):
        console.print(f"  {label:<11}{value}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("TURN", overflow="fold")  # ids are copied from here: fold a long one, never cut it
    table.add_column("PARENT", justify="right", no_wrap=True)  # the parent's row number: short, and the tree shows
    for name in ("MODEL", "FINISH", "ANSWER"):
        table.add_column(name, overflow="fold")
    row_of = {turn["id"]: str(number) for number, turn in enumerate(detail["turns"], 1)}
    for number, turn in enumerate(detail["turns"], 1):
        parent = turn["parent_turn_id"]
        table.add_row(str(number), turn["id"], row_of.get(parent, "other") if parent else "-",
                      turn["requested_model"], turn["finish_reason"] or "-", _answer(turn["response_message"]))
    console.print(table)
    console.print(f"branches ({len(detail['branches'])}):")
    for number, branch in enumerate(detail["branches"], 1):
        console.print(f"  {number}. " + " > ".join(branch))


def _answer(message: dict[str, Any] | None, width: int = 60) -> str:
    """The start of an answer, or the tools it called."""
    if not message:
        return "-"
    if message.get("tool_calls"):
        return "calls " + ", ".join(c.get("function", {}).get("name", "?") for c in message["tool_calls"])
    text = " ".join(str(message.get("content") or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


@trajectories_app.command("export")
def export_command(out: Annotated[Path, typer.Option("--out", "-o", help="File (openai, art) or directory (parquet).")],
                   fmt: Annotated[str, typer.Option("--format", "-f", help="openai, art or parquet.")] = "openai",
                   config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
                   data_dir: DataDirOption = None, database: DatabaseOption = None, alias: AliasOption = None,
                   since: SinceOption = None, until: UntilOption = None, status: StatusOption = None,
                   task: TaskOption = None, has_reward: RewardOption = None,
                   client_key_id: ClientKeyOption = None) -> None:
    """Export trajectories as OpenAI fine-tuning JSONL, ART trajectory JSONL, or Parquet.

    Example: flywheel trajectories export --format openai --out train.jsonl --status closed --has-reward
    """
    from flywheel.capture.export import FORMATS, ExportError, check_destination

    if fmt not in FORMATS:
        fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    try:
        check_destination(out, fmt)
    except ExportError as exc:
        fail(f"--out: {exc}")
    filters = _filters(alias, since, until, status, task, has_reward, client_key_id)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=_console(stderr=True))
    with connect(Target(config, gateway, admin_key, data_dir, database)) as backend:
        ids = _all_ids(backend, filters)
        with progress:
            if fmt == "parquet":
                result = backend.parquet(out, filters, ids, progress)
                summary = (f"exported {_count(result.trajectories, 'trajectory', 'trajectories')} "
                           f"({_count(result.turns, 'turn', 'turns')}) as parquet to {result.trajectories_path} "
                           f"and {result.turns_path}")
            else:
                lines = _write_jsonl(backend, ids, out, fmt, progress)
                summary = (f"exported {_count(len(ids), 'trajectory', 'trajectories')} "
                           f"({_count(lines, 'branch', 'branches')}) as {fmt} to {out}")
    typer.echo(summary)


def _write_jsonl(backend: Backend, ids: list[str], out: Path, fmt: str, progress: Progress) -> int:
    from flywheel.capture.export import jsonl, records

    task = progress.add_task("exporting", total=len(ids))
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = 0
    with out.open("w", encoding="utf-8") as file:
        for trajectory_id in ids:
            detail = backend.detail(trajectory_id)
            if detail is not None:  # deleted since it was listed
                found = records(detail, "openai" if fmt == "openai" else "art")
                file.write(jsonl(found))
                lines += len(found)
            progress.advance(task)
    return lines


@trajectories_app.command("delete")
def delete_command(trajectory_id: Annotated[str | None, typer.Argument(help="The trajectory to delete.")] = None,
                   client_key_id: Annotated[str | None, typer.Option(
                       "--client-key-id", help="Delete everything this client key left instead.")] = None,
                   yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
                   config: ConfigOption = None, gateway: GatewayOption = None, admin_key: AdminKeyOption = None,
                   data_dir: DataDirOption = None, database: DatabaseOption = None) -> None:
    """Delete a trajectory (turns, group memberships, scores, feedback), or all data of a client key.

    Example: flywheel trajectories delete --client-key-id key_0123456789ab --yes
    """
    if (trajectory_id is None) == (client_key_id is None):
        fail("give a trajectory id or --client-key-id (one of them)")
    what = f"trajectory {trajectory_id}" if trajectory_id else f"everything of client key {client_key_id}"
    if not yes:
        if not sys.stdin.isatty():
            fail(f"refusing to delete {what} without --yes (no terminal to ask)")
        typer.confirm(f"Delete {what}?", abort=True)
    with connect(Target(config, gateway, admin_key, data_dir, database)) as backend:
        if trajectory_id is not None:
            found = backend.delete(trajectory_id)
            if found is None:
                fail(f"no trajectory {trajectory_id!r}")
        else:
            assert client_key_id is not None
            found = backend.delete_client(client_key_id)
    rows = found["rows"]
    typer.echo(f"deleted {what}: " + ", ".join(_count(rows[key], one, many) for key, one, many in (
        ("trajectories", "trajectory", "trajectories"), ("turns", "turn", "turns"), ("scores", "score", "scores"),
        ("feedback", "feedback", "feedback"), ("group_members", "group membership", "group memberships"))))
