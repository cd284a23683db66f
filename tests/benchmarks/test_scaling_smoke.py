"""Smoke check of `benchmarks/scaling.py`: every system on a tiny char-lm, one run each, pinned peers.

It checks the summary's keys and types and that each peer ran on the core it was given; no figure's value is
asserted (speed on this shared machine is not a test), except that the step sizes are counted. The pure figures
are checked on hand-written events below.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from scaling import hivemind_sizes, swarm_steps, throughput  # noqa: E402

TINY = ["--total-steps", "3", "--target-batch-size", "32", "--batch-size", "16", "--matchmaking-time", "0.5",
        "--run-timeout", "120", "--set", "eval_every=0", "--set", "d_model=32", "--set", "n_layer=1",
        "--set", "n_head=2", "--set", "seq_len=16", "--set", "max_bytes=100000"]
SYSTEMS = ("local", "local_pair", "swarmrun_1", "swarmrun_2", "hivemind_1", "hivemind_2")
FLOATS = ("speedup_2", "speedup_2_hivemind", "speedup_1", "speedup_1_hivemind", "local_step_s", "step_size_p95_error",
          "ceiling_2", "speedup_2_of_ceiling")


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_scaling_tiny_runs_every_system_pinned_and_reports_the_figures(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--json", *TINY,
                           "--workdir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=400, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"no output; stderr: {done.stderr[-2000:]}"
    summary = json.loads(lines[-1])
    assert done.returncode == 0, f"rc={done.returncode}; failed: {summary.get('failed')}; stderr: {done.stderr[-2000:]}"
    assert summary["event"] == "summary" and summary["failed"] == []
    for key in FLOATS:
        assert isinstance(summary[key], float) and summary[key] >= 0, key
    overhead = summary["round_overhead_2"]  # null (and said on stderr) until the peers report round_overhead_s
    assert overhead is None and "round_overhead_s" in done.stderr or isinstance(overhead, float) and overhead >= 0
    assert isinstance(summary["rounds_abandoned_2"], dict)
    assert summary["step_size_2"]["steps"] == 3 and summary["step_size_2"]["target"] == 32
    runs = {r["system"]: r for r in summary["runs"]}
    assert sorted(runs) == sorted(SYSTEMS)
    cores = summary["settings"]["cores"]
    for system, run in runs.items():
        n = 2 if system.endswith(("_2", "_pair")) else 1
        assert run["cores"] == [[cores[i % len(cores)]] for i in range(n)], system  # one core per peer
        assert run["samples_per_s"] > 0 and run["last_step"] == 3


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_without_a_target_the_benchmark_sizes_one_from_a_measured_local_loop(tmp_path):
    """--target-batch-size left out: a short pinned local loop measures samples/s and the target is what one core
    computes in --step-seconds, in whole local batches of two peers; the runs use it."""
    args = [a for a in TINY if a not in ("--target-batch-size", "32")] + ["--step-seconds", "0.05", "--systems", "local"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--json", *args,
                           "--workdir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    cal, target = summary["calibration"], summary["settings"]["target_batch_size"]
    assert cal["target_batch_size"] == target and cal["step_seconds"] == 0.05 and cal["samples_per_s"] > 0
    assert target % 32 == 0 and target >= 32  # two peers' local batches of 16
    assert target == 32 or abs(target - cal["samples_per_s"] * 0.05) <= 16.1  # the nearest multiple of 32
    assert summary["step_size_2"]["target"] == target and summary["runs"][0]["last_step"] == 3
    assert (tmp_path / "logs" / "calibration").is_dir()


def test_the_figures_count_each_swarm_step_once_at_its_first_report():
    a = [{"step": 1, "time": 10.0, "samples": 30}, {"step": 2, "time": 11.0, "samples": 40},
         {"step": 3, "time": 40.0, "samples": 32}]  # peer a's last round waited out a timeout
    b = [{"step": 1, "time": 10.1}, {"step": 2, "time": 11.1}, {"step": 3, "time": 12.0}]
    steps = swarm_steps([a, b])
    assert [(e["step"], e["time"]) for e in steps] == [(1, 10.0), (2, 11.0), (3, 12.0)]
    fig = throughput(steps, {1: 30, 2: 40, 3: 32}, 32)
    assert fig["samples_per_s"] == pytest.approx((40 + 32) / 2.0)  # the first step is not counted
    assert fig["samples_per_s_at_target"] == pytest.approx(64 / 2.0) and fig["step_s"] == pytest.approx(1.0)
    assert throughput(steps, {2: 40}, 32)["samples_counted"] == 1  # step 3 without a size counts the target
    assert hivemind_sizes([[{"step": 2, "samples_fed": 16}], [{"step": 2, "samples_fed": 20}, {"step": 3}]]) == {2: 36}
