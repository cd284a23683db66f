"""Smoke check of `benchmarks/compression.py`: its whole pipeline at a tiny size (1 seed, none and 8bit, 3 steps).

It checks that both runs finished, that the summary carries the figures the benchmark documents, and that every
committed step held one state_hash on both peers. No figure is asserted: this machine is shared, and at this size
the codebook of an 8-bit part outweighs what it saves.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

KEYS = ("gradient_bytes", "bytes_per_step", "bytes_ratio_8bit", "eval_loss", "samples", "loss_gaps", "loss_gap_8bit",
        "loss_gap_8bit_std", "loss_none_std", "equal_samples", "same_state_hash", "settings", "runs", "failed")
RUN_KEYS = ("codec", "seed", "eval_loss", "samples", "bytes_per_step", "rounds", "same_state_hash")


@pytest.mark.timeout(420)
def test_compression_quick_runs_and_keeps_one_state_hash(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compression.py"), "--quick", "--json",
                           "--workdir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=400, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr: {done.stderr[-2000:]}"
    summary = json.loads(lines[-1])
    assert done.returncode == 0, f"rc={done.returncode}; failed: {summary.get('failed')}; stderr: {done.stderr[-2000:]}"
    assert summary["event"] == "summary" and summary["failed"] == []
    for key in KEYS:
        assert key in summary, key
    assert summary["settings"]["quick"] and summary["settings"]["codecs"] == ["none", "8bit"]
    assert [(r["codec"], r["seed"]) for r in summary["runs"]] == [("none", 1), ("8bit", 1)]
    for run in summary["runs"]:
        assert all(key in run for key in RUN_KEYS)
        assert run["bytes_per_step"] > 0 and run["rounds"] >= 1 and run["same_state_hash"] is True
    assert isinstance(summary["bytes_ratio_8bit"], float) and summary["bytes_ratio_8bit"] > 0
    assert isinstance(summary["loss_gap_8bit"], float)
    assert summary["same_state_hash"] is True
