"""Smoke check of `benchmarks/bootstrap.py`: the whole pipeline on a tiny model, loopback only, one run each.

It checks that every system ran, that the summary carries the figures the issue asks for, and that every
joiner's loaded state hashed to the providers' state. No figure is asserted: this machine is shared.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

KEYS = ("ratio_loopback_4", "ceiling_fraction_loopback_4", "ratio_capped_4", "caps_fraction_capped_4")
SYSTEMS = ("hivemind", "raw_1", "swarmrun_1", "raw_2", "swarmrun_2", "raw_4", "swarmrun_4")


@pytest.mark.timeout(360)
def test_bootstrap_quick_loopback_runs_and_verifies(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bootstrap.py"), "--quick", "--repeats", "1",
                           "--json", "--workdir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=330, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr: {done.stderr[-2000:]}"
    summary = json.loads(lines[-1])
    assert done.returncode == 0, f"rc={done.returncode}; failed: {summary.get('failed')}; stderr: {done.stderr[-2000:]}"
    assert summary["event"] == "summary"
    for key in KEYS:
        assert key in summary
    assert summary["settings"]["quick"] and summary["settings"]["networks"] == ["loopback"]
    assert summary["ratio_capped_4"] is None and summary["caps_fraction_capped_4"] is None  # loopback only
    assert isinstance(summary["ratio_loopback_4"], float) and summary["ratio_loopback_4"] > 0
    assert isinstance(summary["ceiling_fraction_loopback_4"], float) and summary["ceiling_fraction_loopback_4"] > 0
    assert summary["failed"] == []
    runs = {r["system"]: r for r in summary["runs"]}
    assert sorted(runs) == sorted(SYSTEMS)
    for system in ("hivemind", "swarmrun_1", "swarmrun_2", "swarmrun_4"):
        assert runs[system]["verified"] is True
        assert runs[system]["state_hash"] == runs["hivemind"]["state_hash"]  # one state, loaded by every joiner
        assert runs[system]["step"] == 1
    for k in (1, 2, 4):
        assert runs[f"raw_{k}"]["bytes_received"] == runs[f"raw_{k}"]["bytes"]
        assert sum(runs[f"swarmrun_{k}"]["by_provider"].values()) == runs[f"swarmrun_{k}"]["bytes"]
        assert len(runs[f"swarmrun_{k}"]["by_provider"]) == k  # the DHT lookup found exactly k providers
    assert summary["verified_all"] is True
