"""The pool end to end on loopback, through the CLI: a coordinator, two agents (scripted and flag-file residents),
one `synthetic` run of 1 to 2 peers; a resident returns and gets the machine back; the coordinator is SIGKILLed
and restarted on the same SQLite database and has lost nothing.

Every process this test starts runs in its own process group (the agents' peers in theirs, which the agents report
in ``peer_started``); all of them are killed at the end and the test checks none is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.runner import group_exists
from swarmrun.coordinator.client import Client

pytestmark = pytest.mark.timeout(600)

NODE = [sys.executable, "-m", "swarmrun.node.cli"]
START_BOUND = 240  # seconds for the first committed step (peers start hivemind on a shared CPU)
HANDBACK_BOUND = 30  # the resident gets the machine back within this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `node ...` process in its own session, its --json stdout in a file."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict) -> None:
        self.out = workdir / f"{name}.jsonl"
        self.proc = subprocess.Popen([*NODE, *args, "--json"], stdout=open(self.out, "wb"),
                                     stderr=open(workdir / f"{name}.log", "wb"), env=env, start_new_session=True)

    def events(self, kind: str | None = None) -> list[dict]:
        out = []
        for line in self.out.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if kind is None or event.get("event") == kind:
                out.append(event)
        return out

    def wait_event(self, kind: str, bound: float, where=lambda e: True) -> dict:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            found = [e for e in self.events(kind) if where(e)]
            if found:
                return found[0]
            assert self.proc.poll() is None, f"{self.out.name} exited with {self.proc.returncode}"
            time.sleep(0.5)
        raise AssertionError(f"no {kind} event in {self.out.name} within {bound} s")


def _wait(check, bound: float, what: str):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"{what}: not within {bound} s")


def test_pool_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    coord_dir = tmp_path / "coordinator"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    token = subprocess.run([*NODE, "coordinator", "user", "add", "alice", "--state-dir", str(coord_dir)], env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    env.update(SWARMRUN_TOKEN=token, SWARMRUN_COORDINATOR=url)
    client = Client(url, token)
    script = tmp_path / "resident.json"
    script.write_text(json.dumps([[0, False]]))  # w1's resident stays away
    coordinator_args = ["coordinator", "--state-dir", str(coord_dir), "--http", f"127.0.0.1:{port}"]
    procs: list[Proc] = []
    try:
        coordinator = Proc("coordinator", coordinator_args, tmp_path, env)
        procs.append(coordinator)
        coordinator.wait_event("serving", 60)
        agent_common = ["--device", "cpu", "--peer-arg=--matchmaking-time", "--peer-arg=1.0", "--stop-timeout", "20"]
        w1 = Proc("w1", ["agent", "--worker-id", "w1", "--state-dir", str(tmp_path / "w1"),
                         "--resident", f"script:{script}", *agent_common], tmp_path, env)
        w2 = Proc("w2", ["agent", "--worker-id", "w2", "--state-dir", str(tmp_path / "w2"), "--resident", "file",
                         *agent_common], tmp_path, env)
        procs += [w1, w2]
        subprocess.run([*NODE, "submit", "r1", "--task", "synthetic", "--set", "total_steps=100000",
                        "--min-peers", "1", "--max-peers", "2", "--priority", "high"], env=env, check=True)

        # both workers get a peer; the run commits a step and its agents report it
        for agent in (w1, w2):
            agent.wait_event("peer_listening", START_BOUND, lambda e: e["run_id"] == "r1")
        step0 = _wait(lambda: client.get("runs/r1")["run"]["step"], START_BOUND, "a committed step reported")
        assert client.get("runs/r1")["run"]["workers"] == ["w1", "w2"]

        # w2's resident returns: its agent stops its peer within the bound, the run goes on with w1
        subprocess.run([*NODE, "agent", "busy", "--state-dir", str(tmp_path / "w2")], env=env, check=True)
        stopped = w2.wait_event("peer_stopped", HANDBACK_BOUND, lambda e: e["run_id"] == "r1")
        assert stopped["reason"] == "resident returned"
        _wait(lambda: client.get("runs/r1")["run"]["workers"] == ["w1"], 30, "w2 released in the registry")
        _wait(lambda: (client.get("runs/r1")["run"]["step"] or 0) > step0, START_BOUND, "the run goes on after w2 left")
        assert client.get("runs/r1")["run"]["state"] == "running"

        # the coordinator dies; w1's peer trains on; a restarted coordinator on the same database lost nothing
        w1_peer = w1.events("peer_started")[-1]["pid"]
        os.killpg(coordinator.proc.pid, signal.SIGKILL)
        coordinator.proc.wait(10)
        step1 = _wait(lambda: [e["step"] for e in w1.events("peer_step")][-1:], 30, "w1's steps")[0]
        _wait(lambda: max(e["step"] for e in w1.events("peer_step")) > step1, START_BOUND, "w1 trains with no coordinator")
        assert group_exists(w1_peer) and not w1.events("peer_stopped")
        coordinator = Proc("coordinator2", coordinator_args, tmp_path, env)
        procs.append(coordinator)
        coordinator.wait_event("serving", 60)
        run = client.get("runs/r1")["run"]
        assert run["state"] == "running" and run["workers"] == ["w1"] and run["step"] >= step0
        assert {r["run_id"] for r in client.get("runs")["runs"]} == {"r1"}
        _wait(lambda: client.get("runs/r1")["run"]["step"] > step1, START_BOUND, "steps reported to the restarted one")
        assert w1.events("peer_started")[-1]["pid"] == w1_peer  # the agent kept its peer through the restart

        # the owner holds the run: its last peer leaves to a snapshot; released, it resumes from that snapshot
        subprocess.run([*NODE, "hold", "r1"], env=env, check=True)
        stopped = w1.wait_event("peer_stopped", HANDBACK_BOUND, lambda e: e["run_id"] == "r1")
        assert stopped["left"] == "stopped" and not stopped["killed"]
        last = max(e["step"] for e in w1.events("peer_step"))
        snap = _wait(lambda: [e for e in w1.events("peer_snapshot") if e["step"] >= last], 30, "the leave's snapshot")[0]
        _wait(lambda: client.get("runs/r1")["run"]["snapshot_step"] == snap["step"], 30, "the snapshot reported")
        assert client.get("runs/r1")["run"]["state"] == "held" and client.get("runs/r1")["run"]["workers"] == []
        subprocess.run([*NODE, "release", "r1"], env=env, check=True)
        resumed = w1.wait_event("peer_started", START_BOUND, lambda e: e["pid"] != w1_peer)
        assert "--resume-from" in resumed["args"] and "--task" not in resumed["args"]
        _wait(lambda: client.get("runs/r1")["run"]["step"] > snap["step"], START_BOUND, "steps after the resume")
        first = next(e["step"] for e in w1.events("peer_step") if e["step"] and e["time"] > resumed["time"])
        assert first == snap["step"] + 1  # no committed step lost by the pause
    finally:
        groups = [p.proc.pid for p in procs]
        groups += [e["pid"] for p in procs for e in p.events("peer_started")]
        for p in procs[1:3]:  # the agents first: they stop their peers gracefully
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGTERM)
        for p in procs[1:3]:
            try:
                p.proc.wait(40)
            except subprocess.TimeoutExpired:
                pass
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.proc.wait(10)
        _wait(lambda: not any(group_exists(g) for g in groups), 30, "every process group ended")
