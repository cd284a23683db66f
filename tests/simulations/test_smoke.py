"""The runner end to end on the shipped smoke trace: real peers, a kill, a join, a stall and a leave.

The only swarm test of the harness (3 peers live at most, synthetic task); it asserts on summary.json.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_helpers import process_cmdlines

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_smoke_trace_end_to_end(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "simulations", "run", "simulations/traces/smoke.json",
                             "--out", str(out), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    summary = lines[-1]
    assert summary == json.loads((out / "summary.json").read_text()) | {"plots": summary["plots"]}
    assert all(summary["invariants"].values()), (summary["invariants"], summary.get("problems"))
    assert result.returncode == 0
    assert summary["final_step"] == summary["total_steps"] == 36
    assert summary["cursor"]["blocks_skipped"] == 0 and summary["cursor"]["blocks_duplicated"] == 0
    assert summary["faults"] == {"kill": 1, "join": 1, "stall": 1, "leave": 1}
    joiner = summary["joiners"][0]  # joined at step 2 (after the kill), so it had the rest of the run to start and bootstrap
    assert joiner["peer"] == "peer3.0" and joiner["bootstrapped_step"] >= joiner["swarm_step_at_start"]
    assert summary["loss"]["samples"] == summary["samples_applied"]  # compared at equal samples
    assert summary["loss"]["baseline_data"] == "swarm_blocks"  # on the very blocks each step applied
    for name in ("loss_vs_samples.png", "peers_over_time.png", "step_rate.png", "bootstrap_times.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keys = {json.loads(line)["peer"] for line in (out / "events.jsonl").read_text().splitlines()}
    # peer2 is killed at step 2, which peer0 and peer1 (min_peers 2) may reach before peer2's process, slow to import
    # torch on a loaded machine, has printed a line (CI saw it): its life is on record either way, its events may not be
    assert {"peer0.0", "peer1.0", "peer3.0"} <= keys <= {"peer0.0", "peer1.0", "peer2.0", "peer3.0"}
    lives = json.loads((out / "lives.json").read_text())["lives"]
    assert lives["peer2.0"]["ended_by"] == "kill"
    assert summary["run_id"].startswith("sim-smoke-")
    ours = [p for p in process_cmdlines() if summary["run_id"] in p]
    assert not ours, ours  # every peer's process group is gone (the run id is on each peer's command line)

