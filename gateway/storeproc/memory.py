"""What the store process holds in memory, and its bound; ``GET /internal/memory`` (bench/soak.py reads it).

RSS from ``/proc``; DuckDB's own accounting by tag (``duckdb_memory()``: buffers, indexes,
in-memory tables); Python's live objects by type; and, when tracemalloc traces
(``PYTHONTRACEMALLOC=N`` in the gateway's environment, which the store process inherits), the
allocation sites that hold the most. Comparing two reports tells a leak (objects or sites that
keep growing) from a cache with a bound (DuckDB's buffers, up to ``memory_limit``).

What a soak found (docs/benchmarks.md): no Python growth; DuckDB keeps the rows written since its
last checkpoint — their index entries and in-memory segments — until the write-ahead log reaches
16 MB, then writes them out and frees them (a sawtooth), and caches table blocks up to its memory
limit, which defaults to 80% of the machine's RAM: :func:`limit_memory` sets it to
``capture.store_memory_mb``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import tracemalloc
from collections import Counter
from typing import Any

from sqlalchemy import text

from flywheel.capture.store import Store


def limit_memory(store: Store, megabytes: int) -> None:
    """Bound DuckDB's memory (a global setting of the database: one connection sets it for all)."""
    if store.url.startswith("duckdb:"):
        with store.engine.begin() as connection:
            connection.execute(text(f"SET memory_limit = '{int(megabytes)}MB'"))


def memory_report(store: Store, top: int = 20) -> dict[str, Any]:
    report: dict[str, Any] = {"rss_bytes": _rss_bytes(), "python_objects": _objects_by_type(top),
                              "malloc": _malloc_info()}
    pyarrow = sys.modules.get("pyarrow")  # the bulk inserts' Arrow tables come from its own pool
    if pyarrow is not None:
        pool = pyarrow.default_memory_pool()
        report["arrow"] = {"backend": pool.backend_name, "allocated": pool.bytes_allocated(),
                           "peak": pool.max_memory()}
    if store.url.startswith("duckdb:"):
        with store.engine.connect() as connection:
            rows = connection.execute(text("SELECT tag, memory_usage_bytes FROM duckdb_memory()")).all()
        report["duckdb_bytes"] = {tag: int(used) for tag, used in rows if used}
    if tracemalloc.is_tracing():
        sites = tracemalloc.take_snapshot().statistics("lineno")[:top]
        report["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        report["traced_sites"] = [{"site": str(stat.traceback), "bytes": stat.size, "blocks": stat.count}
                                  for stat in sites]
    return report


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _malloc_info() -> dict[str, int]:
    """glibc's heap: bytes in use, bytes held free in its arenas (fragmentation), bytes in mmapped blocks."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"arena": info.arena, "in_use": info.uordblks, "free_in_arenas": info.fordblks, "mmapped": info.hblkhd}


def _objects_by_type(top: int) -> dict[str, int]:
    counts = Counter(type(item).__qualname__ for item in gc.get_objects())
    return {**dict(counts.most_common(top)), "total": sum(counts.values())}
