"""The pool end to end on loopback, through the CLI: a coordinator, two agents (scripted and flag-file residents),
one `synthetic` run of 1 to 2 peers; a resident returns and gets the machine back; the coordinator is SIGKILLed
and restarted on the same SQLite database and has lost nothing.

Isolation on the way: the run is invite-only with the coordinator's owner key; each assigned peer trains with a
certificate the coordinator issued to its peer id; a stranger without one is refused, and so is the released
worker's peer once the coordinator revoked its certificate.

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

from simulations.groups import group_exists, kill_groups
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


def _wait(check, bound: float, what: str, logs: tuple[Path, ...] = ()):
    """``check()`` once it is true; failing after ``bound`` seconds, with the tails of ``logs`` (a peer's stderr:
    what a CI failure can be read from afterwards)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    tails = "".join(f"\n--- {p}:\n{p.read_text(errors='replace')[-4000:]}" for p in logs if p.exists())
    raise AssertionError(f"{what}: not within {bound} s{tails}")


def stop_pool(procs: list[Proc], *, agents: list[Proc]) -> None:
    """The end of a pool test: the agents SIGTERMed first (they stop their peers gracefully), then every process
    group (each process's and each peer's an agent started) SIGKILLed and waited for."""
    groups = [p.proc.pid for p in procs] + [e["pid"] for p in procs for e in p.events("peer_started")]
    for p in agents:
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGTERM)
    for p in agents:
        try:
            p.proc.wait(40)
        except subprocess.TimeoutExpired:
            pass
    kill_groups(groups)
    for p in procs:
        p.proc.wait(10)
    _wait(lambda: not any(group_exists(g) for g in groups), 30, "every process group ended")


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _peer_ids(run_dir: Path) -> list[str]:
    """The peer ids of the peers an agent started in a run's state dir (their `listening` events), oldest first."""
    files = sorted(run_dir.glob("peer-*.jsonl"), key=lambda f: f.stat().st_mtime)
    return [e["peer_id"] for f in files for e in _json_lines(f.read_text()) if e.get("event") == "listening"]


def _refused(name: str, args: list[str], workdir: Path, env: dict) -> dict:
    """`node join` a peer that must be refused: exit code 4 (access refused); returns its error event."""
    proc = subprocess.run([*NODE, "join", *args, "--json"], env=env, capture_output=True, text=True, timeout=240,
                          cwd=workdir)
    (workdir / f"{name}.log").write_text(proc.stderr)
    assert proc.returncode == 4, f"{name} exited with {proc.returncode}: {proc.stdout[-2000:]}"
    return [e for e in _json_lines(proc.stdout) if e.get("event") == "error"][-1]


def _check_certified(agent_dir: Path, events: list[dict]) -> None:
    """The agent's peer trains with a certificate the coordinator issued to its peer id, in an invite-only run whose
    owner is the coordinator's key (not the peer's)."""
    from swarmrun.node import ensure_identity, public_key_bytes, verify_signature
    from swarmrun.node.peer.access import read_certificate_file
    from swarmrun.node.peer.join import read_spec_file
    from swarmrun.protocol.access import admit

    run_dir = agent_dir / "runs" / "r1"
    spec = read_spec_file(str(run_dir / "spec"), "r1").spec if (run_dir / "spec").exists() else None
    peer_id = _peer_ids(run_dir)[-1]
    if spec is not None:
        assert spec.access == "invite" and spec.owner_key != public_key_bytes(ensure_identity(run_dir)[1])
        assert admit(access="invite", run_id="r1", owner_key=spec.owner_key, peer_id=peer_id, now=time.time(),
                     credentials=read_certificate_file(run_dir / "invite"), verifier=verify_signature) is None
    assert any("--invite" in e["args"] for e in events)


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
    coordinator_args = ["coordinator", "--state-dir", str(coord_dir), "--http", f"127.0.0.1:{port}",
                        "--listen", f"/ip4/127.0.0.1/tcp/{_free_port()}", "--revoke-after", "10"]
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

        # isolation: the leader created the run from the coordinator's signed spec (invite-only, the coordinator's
        # key); both peers train with certificates it issued; a stranger with no certificate is refused
        assert "--spec" in w1.events("peer_started")[0]["args"] and "--task" not in w1.events("peer_started")[0]["args"]
        _check_certified(tmp_path / "w1", w1.events("peer_started"))
        _check_certified(tmp_path / "w2", w2.events("peer_started"))
        w1_maddr = w1.events("peer_listening")[-1]["maddr"]
        coordinator_maddrs = coordinator.wait_event("serving", 1)["maddrs"]
        refused = _refused("stranger", ["r1", "--peers", w1_maddr, *coordinator_maddrs, "--state-dir",
                                        str(tmp_path / "stranger")], tmp_path, env)
        assert "invite-only and no certificate" in refused["message"]

        # w2's resident returns: its agent stops its peer within the bound, the run goes on with w1
        subprocess.run([*NODE, "agent", "busy", "--state-dir", str(tmp_path / "w2")], env=env, check=True)
        stopped = w2.wait_event("peer_stopped", HANDBACK_BOUND, lambda e: e["run_id"] == "r1")
        assert stopped["reason"] == "resident returned"
        _wait(lambda: client.get("runs/r1")["run"]["workers"] == ["w1"], 30, "w2 released in the registry")
        _wait(lambda: (client.get("runs/r1")["run"]["step"] or 0) > step0, START_BOUND, "the run goes on after w2 left")
        assert client.get("runs/r1")["run"]["state"] == "running"

        # the released worker's peer is revoked: back with its old certificate, it is refused
        w2_dir = tmp_path / "w2" / "runs" / "r1"
        w2_id = _peer_ids(w2_dir)[-1]
        coordinator.wait_event("revoked", 60, lambda e: w2_id in e["peers"])
        refused = _refused("revoked", ["r1", "--peers", w1_maddr, *coordinator_maddrs, "--state-dir", str(w2_dir),
                                       "--invite", str(w2_dir / "invite")], tmp_path, env)
        assert "revoked" in refused["message"]

        # the coordinator dies; w1's peer trains on; a restarted coordinator on the same database lost nothing
        w1_peer = w1.events("peer_started")[-1]["pid"]
        os.killpg(coordinator.proc.pid, signal.SIGKILL)
        coordinator.proc.wait(10)
        step1 = _wait(lambda: [e["step"] for e in w1.events("peer_step")][-1:], 30, "w1's steps")[0]
        _wait(lambda: max(e["step"] for e in w1.events("peer_step")) > step1, START_BOUND, "w1 trains with no coordinator",
              logs=(tmp_path / "w1" / "runs" / "r1" / "peer.log", tmp_path / "w1.log"))
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
        stop_pool(procs, agents=procs[1:3])
