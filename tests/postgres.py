"""A real PostgreSQL server for the tests: an unprivileged cluster in a temporary directory on a loopback port.

``.ci/run`` installs Debian's ``postgresql`` package; this module runs its ``initdb`` and ``pg_ctl``
(as the ``postgres`` user when the tests run as root: ``initdb`` refuses root), starts the server
on a free loopback port with password authentication, hands each test a database of its own, and
stops the server at the end of the session. Without the package the fixture fails, naming it: a
test that needs PostgreSQL never skips.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from flywheel.gateway.core.processes import free_port

USER = "flywheel"
PASSWORD = "pg-test-secret"  # a test of its own checks that it is never printed
# Test speed only: the cluster is thrown away at the end, so nothing needs to survive a crash.
_FAST = ("-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 "
         "-c unix_socket_directories=''")


def postgres_bin() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``: Debian's newest ``/usr/lib/postgresql/<ver>/bin``, else PATH."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if versions:
        return versions[-1].parent
    found = shutil.which("initdb")
    if found is None:
        raise RuntimeError("PostgreSQL is not installed (no initdb): apt-get install postgresql (.ci/run does)")
    return Path(found).parent


class PostgresServer:
    """One cluster: ``start`` runs initdb and pg_ctl start, ``stop`` pg_ctl stop and removes the directory."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        # initdb refuses to run as root: the cluster belongs to the postgres user then.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def conninfo(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} password={PASSWORD} dbname={database}"

    def start(self) -> PostgresServer:
        password_file = self.root / "password"
        password_file.write_text(PASSWORD + "\n")
        if self.as_user:
            owner = pwd.getpwnam("postgres")
            for path in (self.root, password_file):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, f"--pwfile={password_file}",
                  "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8")
        self._run(str(self.bin / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log),
                  "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 {_FAST}")
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(self.data))
        shutil.rmtree(self.root, ignore_errors=True)

    def create_database(self) -> str:
        """A new, empty database; returns its name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.conninfo(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.conninfo(), autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _run(self, *command: str) -> None:
        done = subprocess.run([*self.as_user, *command], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n{log}")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (started on first use, stopped at the end)."""
    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> Iterator[str]:
    """A SQLAlchemy URL of a fresh database on the session's server, dropped after the test."""
    name = postgres.create_database()
    yield postgres.url(name)
    postgres.drop_database(name)
