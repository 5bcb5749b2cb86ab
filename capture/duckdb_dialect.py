"""The store's SQLAlchemy dialect for DuckDB: duckdb_engine's, with the compiled-statement cache on."""

from __future__ import annotations

import duckdb_engine


class CachingDuckDBDialect(duckdb_engine.Dialect):
    """duckdb_engine's dialect with SQLAlchemy's compiled-statement cache on.

    duckdb_engine turns the cache off, as third-party dialects do until they have vouched for it; its
    statements compile with PostgreSQL's compiler, which caches safely. Without it every statement is
    compiled again: more CPU than DuckDB takes to run most of the store's queries (docs/benchmarks.md)."""

    supports_statement_cache = True
