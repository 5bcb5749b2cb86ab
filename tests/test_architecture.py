"""The import rule of docs/architecture.md §2, read from the code: every import runs down, none in a circle.

Each file belongs to a room (a library, or the gateway's room of the process it runs in); each room stands on
a floor and may import only rooms on lower floors, and itself. Imports inside functions count too: a lazy
import is still an arrow. The SDK stands apart: it talks HTTP, and only the two files that need the server
(LocalBackend starts one, RULER runs its judge) may import it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each part of the `flywheel` namespace lives in the repository (sdk/flywheel links to the four others).
SOURCES = {"flywheel.capture": "capture", "flywheel.judge": "judge", "flywheel.trainer": "trainer",
           "flywheel.gateway": "gateway", "flywheel": "sdk/flywheel"}
FLOORS = {
    "capture": 1,
    "judge": 2, "trainer": 2,
    "gateway.core": 3,
    "gateway.storeproc": 4, "sdk": 4,
    "gateway.serving": 5, "gateway.training": 5,
    "gateway.cli": 6,
    "gateway": 7, "sdk.command": 7,  # the two entry points: `python -m flywheel.gateway` and the `flywheel` command
}
SERVER_ROOMS = {"capture", "judge", "trainer"} | {room for room in FLOORS if room.startswith("gateway")}
SDK_MAY_IMPORT = {"flywheel.local": {"gateway.core"}, "flywheel.rewards": {"judge"}}
OLD_TOP_LEVEL = {"gateway", "capture", "trainer", "judge"}


def modules() -> Iterator[tuple[str, Path]]:
    """(module name, file) for every module of the namespace, each file once."""
    for package, folder in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if package == "flywheel" and parts[0] in OLD_TOP_LEVEL:
                continue  # the links to the four other folders
            yield ".".join((package, *(p for p in parts if p != "__init__"))), path


def room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "flywheel":
        return None
    if len(parts) > 1 and parts[1] in ("capture", "judge", "trainer"):
        return parts[1]
    if len(parts) > 1 and parts[1] == "gateway":
        inner = f"gateway.{parts[2]}" if len(parts) > 2 else "gateway"
        return inner if inner in FLOORS else "gateway"  # gateway/__init__.py and __main__.py
    return "sdk.command" if module == "flywheel.command" else "sdk"


def type_only(tree: ast.Module) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:`` (read by type checkers, never run)."""
    return {inner.lineno for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
        "TYPE_CHECKING") for child in node.body for inner in ast.walk(child)}


def imports(path: Path, known: set[str], *, types: bool = True) -> Iterator[tuple[int, str]]:
    """(line, module) of every module a file imports; `from package import module` names the module.
    ``types=False`` leaves out the imports a type checker alone reads."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if types else type_only(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                yield node.lineno, name if name in known else node.module


def import_graph(*, types: bool = True) -> tuple[dict[str, set[str]], list[str]]:
    found = dict(modules())
    known = set(found)
    graph: dict[str, set[str]] = {module: set() for module in found}
    wrong: list[str] = []
    for module, path in found.items():
        source = room(module)
        assert source is not None
        for line, target in imports(path, known, types=types):
            if target.split(".")[0] in OLD_TOP_LEVEL:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}: the package is flywheel.{target}")
                continue
            destination = room(target)
            if destination is None:
                continue
            if target in known:
                graph[module].add(target)
            if destination == source:
                continue
            if source == "sdk" and destination in SERVER_ROOMS and destination not in SDK_MAY_IMPORT.get(module, ()):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {target} ({destination}): the SDK "
                             "talks HTTP")
            elif FLOORS[destination] >= FLOORS[source]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({source}, floor {FLOORS[source]}) imports {target} "
                             f"({destination}, floor {FLOORS[destination]}): it runs back up")
    return graph, wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_runs_down() -> None:
    _, wrong = import_graph()
    assert not wrong, "\n".join(wrong)


def test_no_modules_import_each_other() -> None:
    """No circle anywhere: not at run time, and not through imports for the type checker alone
    (``if TYPE_CHECKING``); where two files need each other's types, one names what it needs as a Protocol."""
    runtime, _ = import_graph(types=False)
    assert not circles(runtime), circles(runtime)
    graph, _ = import_graph()
    assert not circles(graph), circles(graph)


def test_every_room_has_a_floor() -> None:
    folders = {f"gateway.{p.name}" for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").exists()}
    assert folders <= set(FLOORS), folders - set(FLOORS)


def test_the_rule_catches_an_import_that_runs_back_up(tmp_path: Path) -> None:
    """The checks above can fail: a core module importing the serving process, and a circle."""
    assert room("flywheel.gateway.core.config") == "gateway.core"
    assert FLOORS[room("flywheel.gateway.serving.app") or ""] > FLOORS["gateway.core"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
