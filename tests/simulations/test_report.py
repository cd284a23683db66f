"""The report from a saved record (no peers): summary.json, plots, exit code; refusals of the runner."""

import json

import pytest

from simulations.__main__ import main as sim_main
from simulations.checks import as_jsonable
from simulations.trace import parse_trace
from tests.simulations.test_checks import healthy

SMOKE = "simulations/traces/smoke.json"


def write_record(folder, rec, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lives.json").write_text(json.dumps(dict(as_jsonable(rec), run_id="sim-x-1", cleaned=True, **extra)))
    with open(folder / "events.jsonl", "w") as f:
        for t, key, e in rec.events:
            f.write(json.dumps(dict(t=t, peer=key, **e)) + "\n")


def test_report_of_a_healthy_record_passes_and_draws_every_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[2])
    rec = healthy()
    rec.events.append((7.2, "peer0.0", {"event": "eval", "step": 3, "loss": 0.5}))
    write_record(tmp_path / "run", rec)
    assert sim_main(["report", str(tmp_path / "run"), "--trace", SMOKE, "--no-baseline", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 3 and summary["samples_applied"] == 3 * 64
    assert summary["joiners"][0]["bootstrapped_step"] == 2
    for name in summary["plots"]:
        assert (tmp_path / "run" / name).read_bytes()[:4] == b"\x89PNG"
    assert len(summary["plots"]) == 4


def test_report_exits_1_when_an_invariant_fails_or_the_run_was_interrupted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[2])
    rec = healthy()
    rec.events.append((7.3, "peer2.0", {"event": "step", "step": 3, "state_hash": "fork", "samples": 64}))
    write_record(tmp_path / "fork", rec)
    assert sim_main(["report", str(tmp_path / "fork"), "--trace", SMOKE, "--no-baseline", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["invariants"]["state_hash_agrees"] is False
    write_record(tmp_path / "cut", healthy(), interrupted=True)
    assert sim_main(["report", str(tmp_path / "cut"), "--trace", SMOKE, "--no-baseline", "--json"]) == 1
    assert sim_main(["report", str(tmp_path / "nothing"), "--trace", SMOKE]) == 2


def test_the_runner_refuses_a_pause_when_this_swarmrun_cannot_pause(tmp_path, monkeypatch):
    from simulations import runner
    from swarmrun.protocol.errors import UsageError

    trace = parse_trace({"seed": 1, "events": [{"step": 3, "kind": "pause", "duration": 5, "peers": 2}]})
    monkeypatch.setattr(runner, "pause_supported", lambda: False)
    with pytest.raises(UsageError, match="no `node pause`"):
        runner.Simulation(trace, logs=tmp_path, emit=lambda *a, **k: None)
    monkeypatch.undo()
    assert runner.pause_supported()  # this swarmrun has `node pause` and `--resume-from`


def test_the_loss_comparison_reports_the_data_order_noise_beside_the_check():
    from simulations.report import compare_loss

    rec = healthy()
    rec.events.append((7.2, "peer0.0", {"event": "eval", "step": 3, "loss": 1.03}))
    baseline = {"eval": {3: 1.0}, "samples": {3: 192}, "other_orders": [{3: 0.99}, {3: 1.04}]}
    loss = compare_loss(rec, baseline, rel_tol=0.02, abs_tol=0.0)
    assert loss["ok"] is False and abs(loss["relative_difference"] - 0.03) < 1e-9  # the check itself is unchanged
    noise = loss["data_order_noise"]
    assert noise["losses"] == [0.99, 1.04] and abs(noise["max"] - 0.04) < 1e-9
    assert "data_order_noise" not in compare_loss(rec, {"eval": {3: 1.0}, "samples": {3: 192}}, rel_tol=0.02, abs_tol=0.0)


def test_the_baseline_replays_the_swarms_blocks_and_falls_back_to_the_data_order(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[2])
    for name, step3 in (("replay", [[16, 24]]), ("wrong", [[16, 17]])):  # block size 8: 64 samples, then 8
        rec = healthy()
        for _, _, e in rec.events:
            if e["event"] == "step":
                e["blocks"] = {1: [[0, 8]], 2: [[8, 16]], 3: step3}[e["step"]]
        rec.events.append((7.2, "peer0.0", {"event": "eval", "step": 3, "loss": 0.5}))
        write_record(tmp_path / name, rec)
        sim_main(["report", str(tmp_path / name), "--trace", SMOKE, "--json"])  # 1: the record's made-up eval loss
        loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
        assert loss["step"] == 3 and loss["baseline_data"] == {"replay": "swarm_blocks", "wrong": "data_order"}[name]
        assert loss["baseline_loss"] > 0
