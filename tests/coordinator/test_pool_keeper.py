"""The coordinator's keeper of a running pool run, on loopback through the CLI: a coordinator and two agents train a
`synthetic` run; the coordinator starts a `node keep` of it with a certificate it issued; when both trainers and
their agents are SIGKILLed at once (workstations powered off, no leave, no leave snapshot), the keeper still
provides a state the trainers committed, at least as new as the one it held before they died (the keeper follows
the run by fetching or replaying what it commits, not inside its rounds, so it may trail the newest step by a
report interval and a catch-up). A coordinator killed with SIGKILL leaves no keeper behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.groups import group_exists, kill_groups
from tests.coordinator.test_pool_e2e import NODE, START_BOUND, Proc, _free_port, _wait, stop_pool

pytestmark = pytest.mark.timeout(400)

TARGET_BATCH = 8192  # 128 batches of 64 per step: a lone peer's step takes a fraction of a second here


def _status(run_id: str, maddrs: list[str], env: dict, workdir: Path) -> dict:
    done = subprocess.run([*NODE, "status", run_id, "--peers", *maddrs, "--state-dir", str(workdir / "status"),
                           "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]


def test_the_keeper_holds_a_run_whose_trainers_all_vanished(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    coord_dir = tmp_path / "coordinator"
    port = _free_port()
    token = subprocess.run([*NODE, "coordinator", "user", "add", "alice", "--state-dir", str(coord_dir)], env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    env.update(SWARMRUN_TOKEN=token, SWARMRUN_COORDINATOR=f"http://127.0.0.1:{port}")
    procs: list[Proc] = []
    keeper_pid = None
    try:
        coordinator = Proc("coordinator", ["coordinator", "--state-dir", str(coord_dir), "--http", f"127.0.0.1:{port}",
                                           "--listen", f"/ip4/127.0.0.1/tcp/{_free_port()}"], tmp_path, env)
        procs.append(coordinator)
        maddrs = coordinator.wait_event("serving", 60)["maddrs"]
        agents = [Proc(w, ["agent", "--worker-id", w, "--state-dir", str(tmp_path / w), "--resident", "file",
                           "--device", "cpu", "--peer-arg=--matchmaking-time", "--peer-arg=1.0"], tmp_path, env)
                  for w in ("w1", "w2")]
        procs += agents
        # steps of a fraction of a second, as a real run's: at the synthetic task's default T (one batch) a lone
        # leader commits ~200 steps a second, which no joiner or keeper fetching its state can follow step by step
        subprocess.run([*NODE, "submit", "r1", "--task", "synthetic", "--set", "total_steps=100000",
                        "--set", f"target_batch_size={TARGET_BATCH}", "--set", "num_examples=65536",
                        "--min-peers", "2", "--max-peers", "2"], env=env, check=True)
        keeper_pid = coordinator.wait_event("keeper_started", START_BOUND, lambda e: e["run_id"] == "r1")["pid"]
        # the keeper is certified by the coordinator and holds the run's state as the run steps
        keeper_dir = coord_dir / "keepers" / "r1"
        assert (keeper_dir / "invite").read_text().strip()
        _wait(lambda: [p for p in _status("r1", maddrs, env, tmp_path)["providers"] if p["keeper"] and p["step"] >= 3],
              START_BOUND, "the keeper provides a state of step 3 or later")
        # past its bootstrap, following: twice, the keeper reaches a step the trainers had reached before
        for _ in range(2):
            trainers_then = max(p["step"] for p in _status("r1", maddrs, env, tmp_path)["providers"] if not p["keeper"])
            held = _wait(lambda: [p["step"] for p in _status("r1", maddrs, env, tmp_path)["providers"]
                                  if p["keeper"] and p["step"] >= trainers_then], START_BOUND, "the keeper follows")
        held_before = max(held)

        # the workstations are powered off: both agents and their peers die at once, no leave, no snapshot
        groups = [a.proc.pid for a in agents] + [a.events("peer_started")[-1]["pid"] for a in agents]
        kill_groups(groups)
        commits = {}  # step -> the state_hash the trainers committed it with
        for agent in agents:
            agent.proc.wait(10)
            for trainer_file in (tmp_path / agent.out.stem / "runs" / "r1").glob("peer-*.jsonl"):
                events = [json.loads(x) for x in trainer_file.read_text().splitlines() if '"event": "step"' in x]
                commits.update((e["step"], e["state_hash"]) for e in events)
        newest = max(commits)
        status = _status("r1", maddrs, env, tmp_path)
        kept = [p for p in status["providers"] if p["keeper"]]
        assert kept, status["providers"]
        # a state the trainers committed (its hash is theirs at that step), no older than what the keeper held before
        assert held_before <= kept[0]["step"] <= newest, (kept, held_before, newest)
        assert kept[0]["state_hash"] == commits[kept[0]["step"]], (kept, commits.get(kept[0]["step"]))

        # a coordinator killed with SIGKILL takes its keeper with it (the keeper's parent-death signal)
        os.killpg(coordinator.proc.pid, signal.SIGKILL)
        coordinator.proc.wait(10)
        _wait(lambda: not group_exists(keeper_pid), 40, "the keeper left with its coordinator")
    finally:
        stop_pool(procs, agents=[])
        if keeper_pid is not None:
            kill_groups([keeper_pid])
