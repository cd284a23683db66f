"""A split and its reunion with real peers (issue 14): 3 peers in network namespaces, one cut off for 18 s.

The cut-off peer waits ``alone_after`` (2 s here) once the others' reports expire, then steps alone; the other two
go on as a majority. When the link heals, the majority's history wins: the minority re-syncs to it (to an older
step if it stepped further alone) and reports the steps it discarded, the majority never re-syncs to the
minority, and the run ends with one state everywhere and every invariant true on the run's history.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_helpers import process_cmdlines

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_the_majority_history_wins_a_reunion(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "simulations", "run", "simulations/traces/split.json",
                             "--out", str(out), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    summary = lines[-1]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    faults = json.loads((out / "lives.json").read_text())["faults"]
    cut = next(e["t"] for e in faults if e["kind"] == "partition")
    healed = next(e["t"] for e in faults if e["kind"] == "partition_end")
    alone = [e for e in events if e.get("event") == "step" and e["peer"] == "peer2.0" and cut < e["t"] < healed]
    assert alone and all(e["peers"] == 1 for e in alone), alone  # the minority stepped alone while cut off
    resyncs = [e for e in events if e.get("event") == "resync"]
    minority = [e for e in resyncs if e["peer"] == "peer2.0" and e["t"] > healed]
    assert any(e["discarded"] > 0 for e in minority), resyncs  # ... gave its steps up, and said so
    assert not any(e["discarded"] for e in resyncs if e["peer"] != "peer2.0"), resyncs  # the majority kept its own
    majority_steps = {e["step"]: e["state_hash"] for e in events
                      if e.get("event") == "step" and e["peer"] == "peer0.0" and cut < e["t"] < healed}
    assert majority_steps, "the majority committed nothing while the minority was cut off"
    left = {e["peer"]: e for e in events if e.get("event") == "left"}
    assert left["peer2.0"]["steps_discarded"] > 0 and left["peer0.0"]["steps_discarded"] == 0
    assert {e["state_hash"] for e in left.values()} == {left["peer0.0"]["state_hash"]}  # one final state
    assert all(summary["invariants"].values()), (summary["invariants"], summary.get("problems"))
    assert summary["final_step"] == summary["total_steps"] == 60 and result.returncode == 0
    ours = [p for p in process_cmdlines() if summary["run_id"] in p]
    assert not ours, ours
