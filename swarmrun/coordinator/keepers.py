"""The coordinator's keepers: one ``node keep`` per pool run that is running, so a run whose trainers all vanish at
once (workstations powered off, a lab's network cut) still has a provider of its newest state, not only the
store's last snapshot.

Each keeper is a child process group of the coordinator (``node keep RUN --peers <the coordinator's peer>``) with
its own state dir (``STATE_DIR/keepers/RUN_ID``, its identity kept there so a restarted coordinator's keeper has
the same peer id) and a certificate the coordinator issues itself with the run's owner key (a pool run is
invite-only). A keeper holds and serves the state; it never trains, so it takes no worker's place in placement.

Lifetimes: a keeper starts once its run is running and reported a step (its peers published the spec the
keeper reads), and is stopped (SIGTERM, SIGKILL after ``STOP_TIMEOUT``) when the run is no longer running (held,
paused to a snapshot, finished, cancelled: the store holds it then). A keeper that exits is started again after
``RESTART_AFTER`` seconds, doubling up to ten times that, so a task not installed on the coordinator's machine
(the keeper exits 5) costs one line in the log per backoff, not a loop. Each keeper dies with the coordinator
(``PR_SET_PDEATHSIG``): a coordinator killed with SIGKILL leaves no keeper behind, and its restart starts them
again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

__all__ = ["Keepers", "keeper_listen", "RESTART_AFTER", "STOP_TIMEOUT"]

logger = logging.getLogger("swarmrun.coordinator")
RESTART_AFTER = 30.0
STOP_TIMEOUT = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:  # in the child, before exec
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the coordinator died between the fork and the prctl: no signal will come
        os._exit(1)


def keeper_listen(listen: Sequence[str]) -> str:
    """The multiaddr a keeper listens on: the coordinator peer's host, a port of the OS's choosing."""
    parts = (listen[0] if listen else "/ip4/127.0.0.1/tcp/0").split("/")
    if len(parts) >= 5 and parts[3] == "tcp":
        parts[4] = "0"
        return "/".join(parts[:5])
    return "/ip4/127.0.0.1/tcp/0"


@dataclass
class _Keeper:
    proc: Optional[subprocess.Popen] = None
    failures: int = 0
    next_start: float = 0.0


class Keepers:
    """The keepers of one coordinator. ``certify(run_id, peer_id) -> certificate text``; ``bootstrap``: the
    coordinator peer's multiaddrs; ``emit(kind, **fields)`` records what happened (the service's events)."""

    def __init__(self, state_dir: Path, *, bootstrap: Sequence[str], listen: str,
                 certify: Callable[[str, str], str], emit: Callable[..., None] = lambda *a, **k: None,
                 clock: Callable[[], float] = time.monotonic, node: Sequence[str] = ()) -> None:
        self.root = Path(state_dir) / "keepers"
        self.bootstrap, self.listen, self.certify, self.emit, self.clock = tuple(bootstrap), listen, certify, emit, clock
        self.node = tuple(node) or (sys.executable, "-m", "swarmrun.node.cli")
        self.keepers: dict[str, _Keeper] = {}
        self.stopping: list[tuple[float, subprocess.Popen]] = []  # (when to SIGKILL, process) told to stop

    def reconcile(self, runs: Iterable[Mapping]) -> None:
        """Start the keepers of running runs that reported a step, stop the others' (rows: ``run_id``,
        ``state``, ``step``). Never blocks on a process: a keeper told to stop is SIGKILLed by a later call once
        ``STOP_TIMEOUT`` passed. Call it from the thread that will outlive the keepers (their parent-death
        signal follows the thread that started them): the coordinator's event loop."""
        self._reap()
        wanted = {r["run_id"] for r in runs if r["state"] == "running" and r.get("step") is not None}
        for run_id in sorted(set(self.keepers) - wanted):
            self._stop(run_id, "the run is not running")
        for run_id in sorted(wanted):
            keeper = self.keepers.setdefault(run_id, _Keeper())
            if keeper.proc is not None and keeper.proc.poll() is not None:
                self._exited(run_id, keeper)
            if keeper.proc is None and self.clock() >= keeper.next_start:
                self._start(run_id, keeper)

    def _start(self, run_id: str, keeper: _Keeper) -> None:
        from swarmrun.node import ensure_identity, peer_id_of, public_key_bytes

        state_dir = self.root / run_id
        state_dir.mkdir(parents=True, exist_ok=True)
        _, key = ensure_identity(state_dir)
        (state_dir / "invite").write_text(self.certify(run_id, peer_id_of(public_key_bytes(key))))
        args = [*self.node, "keep", run_id, "--peers", *self.bootstrap, "--state-dir", str(state_dir),
                "--invite", str(state_dir / "invite"), "--listen", self.listen, "--json"]
        with open(state_dir / "keeper.jsonl", "ab") as out, open(state_dir / "keeper.log", "ab") as err:
            keeper.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                           preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        self.emit("keeper_started", run_id=run_id, pid=keeper.proc.pid)

    def _exited(self, run_id: str, keeper: _Keeper) -> None:
        code = keeper.proc.returncode
        keeper.proc = None
        keeper.failures += 1
        delay = min(RESTART_AFTER * 2 ** (keeper.failures - 1), 10 * RESTART_AFTER)
        keeper.next_start = self.clock() + delay
        logger.warning(f"the keeper of run {run_id} exited with code {code}; starting it again in {delay:.0f}s "
                       f"(see {self.root / run_id / 'keeper.log'})")
        self.emit("keeper_exited", run_id=run_id, code=code, restart_in=delay)

    def _stop(self, run_id: str, why: str) -> None:
        keeper = self.keepers.pop(run_id)
        if keeper.proc is not None and keeper.proc.poll() is None:
            _signal(keeper.proc, signal.SIGTERM)  # it leaves as a peer does: announces it, closes its DHT
            self.stopping.append((self.clock() + STOP_TIMEOUT, keeper.proc))
            self.emit("keeper_stopped", run_id=run_id, reason=why)

    def _reap(self) -> None:
        left = []
        for deadline, proc in self.stopping:
            if proc.poll() is None and self.clock() >= deadline:
                _signal(proc, signal.SIGKILL)
            if proc.poll() is None:
                left.append((deadline, proc))
        self.stopping = left

    def close(self) -> None:
        """Stop every keeper and wait for them (blocking: the coordinator is leaving)."""
        _terminate([k.proc for k in self.keepers.values() if k.proc is not None] + [p for _, p in self.stopping])
        self.keepers.clear()
        self.stopping = []


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, SIGKILL what is left after ``STOP_TIMEOUT``."""
    procs = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            _signal(p, sig)
        deadline = time.monotonic() + STOP_TIMEOUT
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return
