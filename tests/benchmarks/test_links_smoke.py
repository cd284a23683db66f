"""Smoke check of `benchmarks/links.py`: its whole pipeline at a tiny size (4 peers in network namespaces, capped
and delayed links, synchronous fp32 and outer mode with 8-bit, a few steps).

It checks that both modes finished with every harness invariant true and one state_hash per step, that the
figures the benchmark documents are there and measured (bytes read off the links, compute from the peers'
`compute_s`), and that outer mode sent fewer bytes per sample. No speed is asserted: the machine is shared.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

RUN_KEYS = ("bytes_per_sample", "tensor_bytes_per_sample", "utilisation", "samples_per_second", "eval_loss",
            "samples_applied", "steps", "same_state_hash")


@pytest.mark.timeout(600)
def test_links_quick_runs_both_modes_over_namespaces(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces and tc need root")
    if shutil.which("nft") is None:
        pytest.skip("nft (Debian's nftables) is not installed: the README's test command installs it")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "links.py"), "--quick", "--json",
                           "--workdir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=580, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no output; stderr: {done.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert done.returncode == 0, f"rc={done.returncode}; failed: {summary.get('failed')}; stderr: {done.stderr[-3000:]}"
    assert summary["event"] == "summary" and summary["failed"] == {}
    assert list(summary["runs"]) == ["sync32", "outer4_8bit"]
    runs = [json.loads(line) for line in lines[:-1]]
    assert [r["mode"] for r in runs] == ["sync32", "outer4_8bit"]
    for run in runs:
        assert all(key in run for key in RUN_KEYS), run
        assert all(run["invariants"].values()), (run["mode"], run["problems"])
        assert run["same_state_hash"] is True and run["mean_group"] > 1
        assert run["bytes_per_sample"] > run["tensor_bytes_per_sample"] > 0  # the links carry the tensors and more
        assert 0 < run["utilisation"] <= 1
        # the same budget in both modes. sync32 ends at the first step that reaches 512 samples, so it may pass it
        # by up to a step of 64 (a step may be long within its tolerance: CI saw it end at 552); outer mode runs the
        # budget's 2 outer steps of 256, each within the step's tolerance (under a sample budget it once took a
        # third step after steps of 256 and 248, and ended at 776)
        if run["mode"] == "sync32":
            assert 512 <= run["samples_applied"] < 512 + 2 * 64
        else:
            assert run["steps"] == 2 and abs(run["samples_applied"] - 512) <= 0.1 * 512, run
    assert summary["same_state_hash"] is True and summary["invariants_true"] is True
    assert summary["equal_samples"] is True
    assert summary["tensor_bytes_ratio_outer8"] > 1 and summary["bytes_ratio_outer8"] > 1
    assert isinstance(summary["utilisation_outer8"], float)
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == namespaces
