"""Real `node join` peers for tests: each in its own session, always killed as a whole process group."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarmrun.node.cli.demo import PeerProcess, start_peer


class Swarm:
    """A set of peers of one run; ``with Swarm(tmp_path) as swarm:`` kills every one of them on exit."""

    def __init__(self, workdir: Path, run_id: str = "test-run"):
        self.workdir, self.run_id = workdir, run_id
        self.sink: queue.Queue = queue.Queue()
        self.peers: dict[str, PeerProcess] = {}
        self.maddr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for peer in self.peers.values():
            peer.kill_group(signal.SIGKILL)
        for peer in self.peers.values():
            try:
                peer.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def create(self, name: str, *args: str, env: dict | None = None) -> PeerProcess:
        peer = self._start(name, [self.run_id, *args], env)
        self.maddr = self.wait_for(name, "listening", timeout=90)["maddrs"][0]
        return peer

    def join(self, name: str, *args: str, env: dict | None = None) -> PeerProcess:
        return self._start(name, [self.run_id, "--peers", self.maddr, *args], env)

    def start_keeper(self, name: str, env: dict | None = None) -> PeerProcess:
        """`node keep` the run: holds and serves its state, does not train."""
        peer = start_peer(name, [self.run_id, "--peers", self.maddr, "--state-dir", str(self.workdir / name)],
                          workdir=self.workdir, sink=self.sink, command="keep")
        self.peers[name] = peer
        return peer

    def _start(self, name, args, env):
        old = dict(os.environ)
        try:
            os.environ.update(env or {})
            peer = start_peer(name, [*args, "--state-dir", str(self.workdir / name), "--device", "cpu"],
                              workdir=self.workdir, sink=self.sink)
        finally:
            os.environ.clear()
            os.environ.update(old)
        self.peers[name] = peer
        return peer

    def wait_for(self, name: str, event: str, timeout: float, **match) -> dict:
        """Wait until peer ``name`` printed ``event`` (with the given field values)."""
        peer = self.peers[name]
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for e in peer.events[seen:]:
                seen += 1
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            if not peer.alive and seen >= len(peer.events):
                time.sleep(0.2)  # let the pump thread drain stdout
                if seen >= len(peer.events):
                    raise AssertionError(f"{name} exited ({peer.proc.returncode}) without {event}: {self.log(name)[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{name} printed no {event} {match} within {timeout}s: {self.log(name)[-2000:]}")

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.peers[name].proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            others = "".join(f"\n--- {other}: {self.log(other)[-1500:]}" for other in self.peers if other != name)
            raise AssertionError(f"{name} did not exit within {timeout}s: {self.log(name)[-2000:]}{others}") from None

    def log(self, name: str) -> str:
        """The peer's stderr and its last events (for failure messages)."""
        path = self.workdir / f"{name}.log"
        err = path.read_text(errors="replace") if path.exists() else ""
        tail = [e for e in self.peers[name].events if e.get("event") != "progress"][-8:]
        return f"{err[-3000:]}\nlast events: {tail}"

    def events(self, name: str, event: str) -> list[dict]:
        return [e for e in self.peers[name].events if e.get("event") == event]


def run_cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `node ARGS` to completion in its own session (killed as a group on timeout)."""
    proc = subprocess.Popen([sys.executable, "-m", "swarmrun.node.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"node {' '.join(args)} timed out: {err[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def process_cmdlines() -> list[str]:
    """Every live process's command line (NULs as spaces), for tests that check a run left nothing behind."""
    rows = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                rows.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return rows
