"""Fixtures of the coordinator's tests: every registry test runs on SQLite and on a real PostgreSQL.

The PostgreSQL server is started once per session in a temporary directory (data, unix socket
and log all inside it) on a free loopback port, with a random password for TCP, and stopped and
deleted after. PostgreSQL refuses to run as root, so as root the server runs as ``nobody``
(through ``runuser``, or ``setpriv`` where runuser is missing) in a directory chowned to it.
Tests skip only when the server binaries are not installed, and say so.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmrun.coordinator.registry import Registry

_START_TIMEOUT = 60  # seconds for pg_ctl -w; a cold initdb'd cluster starts in about one


class FakeClock:
    """An injected clock: time moves only when a test moves it."""

    def __init__(self, now: float = 1_700_000_000.5) -> None:  # a real epoch with a fraction: a 32-bit float column would lose it
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


def _server_binaries() -> tuple[str, str] | None:
    """initdb and pg_ctl: from PATH, else the newest Debian-style /usr/lib/postgresql/N/bin."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return initdb, pg_ctl
    for bin_dir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(f"{bin_dir}/initdb", os.X_OK) and os.access(f"{bin_dir}/pg_ctl", os.X_OK):
            return f"{bin_dir}/initdb", f"{bin_dir}/pg_ctl"
    return None


def _as_server_user() -> tuple[list[str], int | None, int | None]:
    """The command prefix that runs the server as a non-root user, and that user's uid/gid."""
    if os.geteuid() != 0:
        return [], None, None
    nobody = pwd.getpwnam("nobody")
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"], nobody.pw_uid, nobody.pw_gid
    if shutil.which("setpriv"):
        prefix = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        return prefix, nobody.pw_uid, nobody.pw_gid
    raise RuntimeError("running as root, PostgreSQL needs another user, and neither runuser nor setpriv is installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    """A running throwaway PostgreSQL: superuser ``postgres`` with ``password`` on loopback ``port``."""

    port: int
    password: str

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database (one per test: no state leaks between tests); returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:16]}"
        conninfo = f"host=127.0.0.1 port={self.port} user=postgres password={self.password} dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _start(pg_ctl: str, prefix: list[str], data: Path, root: Path) -> int:
    """Start the server on a free port; a port taken between probe and bind gets one more try."""
    for attempt in range(3):
        port = _free_port()
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c unix_socket_permissions=0700"
        log = root / "server.log"
        result = subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", str(_START_TIMEOUT), "-o", options, "start"],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode == 0:
            return port
        tail = log.read_text()[-2000:] if log.exists() else result.stderr
        if "could not bind" not in tail or attempt == 2:
            raise RuntimeError(f"pg_ctl start failed:\n{result.stdout}{result.stderr}\n{tail}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the session, in a temporary directory deleted after."""
    binaries = _server_binaries()
    if binaries is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: install postgresql to run the PostgreSQL half")
    initdb, pg_ctl = binaries
    prefix, uid, gid = _as_server_user()
    # Not under pytest's tmp dir: that is private to root, and the server's user must reach it.
    root = Path(tempfile.mkdtemp(prefix="swarmrun-pg-"))
    password = secrets.token_hex(16)
    (root / "pwfile").write_text(password + "\n")
    if uid is not None:
        for path in (root, root / "pwfile"):
            os.chown(path, uid, gid)
    data = root / "data"
    started = False
    try:
        result = subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "postgres", f"--pwfile={root / 'pwfile'}", "--auth-local=trust",
             "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{result.stdout}{result.stderr}")
        port = _start(pg_ctl, prefix, data, root)
        started = True
        yield PostgresServer(port=port, password=password)
    finally:
        if started:
            subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A URL of an empty database: an SQLite file, or a fresh database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    return request.getfixturevalue("postgres_server").create_database()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(db_url, clock):
    reg = Registry(db_url, clock=clock)
    yield reg
    reg.close()
