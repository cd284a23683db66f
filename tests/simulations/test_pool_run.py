"""The pool trace end to end, on a short variant of the shipped `pool` trace: a real coordinator (SQLite), three
agents, a low-priority run shrunk by a high-priority one, a resident's return, a coordinator SIGKILL and restart.
It asserts on summary.json that every invariant held, and that no process of the run is left.

The shipped trace (`simulations/traces/pool.json`, 6 agents, 3 runs, a pause) is the longer measurement; see
simulations/README.md for its figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_helpers import process_cmdlines

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SHORT = {
    "kind": "pool", "name": "pool-short", "task": "synthetic", "workers": 3, "duration": 300,
    "min_residence": 5, "stop_timeout": 20, "handback_bound": 30, "utilisation_target": 0.9,
    "peer_args": ["--min-peers", "2"],
    "runs": {
        "big": {"priority": 0, "min_peers": 1, "max_peers": 3, "sets": {"total_steps": 30, "eval_every": 10}},
        "exp": {"priority": 2, "min_peers": 2, "max_peers": 2, "sets": {"total_steps": 10, "eval_every": 5}},
    },
    "events": [
        {"time": 0, "kind": "submit", "run": "big"},
        {"after": {"run": "big", "step": 4}, "kind": "resident", "worker": "w3", "duration": 10},
        {"after": {"run": "big", "step": 12}, "kind": "submit", "run": "exp"},
        {"after": {"run": "exp", "step": 3}, "kind": "coordinator_kill", "down": 5},
    ],
}


def test_pool_trace_end_to_end(tmp_path):
    trace, out = tmp_path / "pool-short.json", tmp_path / "report"
    trace.write_text(json.dumps(SHORT))
    result = subprocess.run([sys.executable, "-m", "simulations", "run", str(trace), "--out", str(out), "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=580)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    summary = lines[-1]
    assert all(summary["invariants"].values()), (summary["invariants"], summary.get("problems"))
    assert result.returncode == 0
    for name in ("utilisation", "committed_steps_lost", "handback_seconds_max", "preemption_seconds",
                 "coordinator_restarts"):
        assert name in summary
    assert summary["committed_steps_lost"] == 0 and summary["utilisation"] >= 0.9
    assert len(summary["preemption_seconds"]) == 1 and summary["preemptions"][0]["from_runs"] == ["big"]
    assert 0 < summary["handback_seconds_max"] <= 30
    assert len(summary["coordinator_restarts"]) == 1 and not summary["coordinator_restarts"][0]["lost_runs"]
    assert {r["state"] for r in summary["pauses_and_resumes"] if r["run"] == "exp"} >= {"running", "finished"}
    for run in ("big", "exp"):
        assert summary["runs"][run]["final_step"] == summary["runs"][run]["total_steps"]
        assert summary["runs"][run]["loss"]["baseline_data"] == "swarm_blocks"
    for name in ("gantt.png", "pool_steps.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ours = [p for p in process_cmdlines() if str(tmp_path) in p or "swarmrun-pool-" in p]
    assert not ours, ours  # the coordinator, the agents and every peer are gone (their state dirs are on their command lines)
