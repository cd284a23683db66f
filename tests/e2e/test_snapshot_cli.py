"""`node snapshot ls|inspect|verify|export|import` and the refusals of `--resume-from` (bad snapshot, bad --set)."""

import json
from types import SimpleNamespace

import pytest
import torch

from swarmrun.node.peer.build import initial_state, make_spec
from swarmrun.node.state.store import SnapshotStore
from swarmrun.node.cli.snapshot import run_command
from swarmrun.node.peer.snapshots import apply_resume, plan_resume
from swarmrun.node.net.swarm import ensure_identity, public_key_bytes
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.errors import AccessRefused, IncompatibleState, UsageError
from swarmrun.protocol.snapshot import Amendment
from swarmrun.protocol.spec import SignedSpec
from tests.swarm_helpers import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # real peers: more than the default 60 s


class Recorder:
    json_mode = True

    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append(dict(event=event, **fields))


def json_lines(result):
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def make_store(tmp_path, run_id="cli-run", steps=(1, 2)):
    """A store with snapshots of a synthetic run at ``steps`` (owner key in tmp_path/owner)."""
    key = ensure_identity(tmp_path / "owner")[1]
    spec, task = make_spec(run_id=run_id, task_cls=SyntheticTask, sets={"total_steps": "20"}, seed=7,
                           owner_key=public_key_bytes(key))
    signed = SignedSpec.sign(spec, key.sign).encode()
    state = initial_state(spec, task, "cpu")
    store = SnapshotStore(str(tmp_path / "store"))
    for step in steps:
        state.step = step
        with torch.no_grad():
            next(state.model.parameters()).add_(1.0)
        store.write(state.freeze(chunk_size=1024), signed_spec=signed)
    return store, key, spec


def test_ls_inspect_verify_and_a_corrupt_chunk(tmp_path):
    store, _, spec = make_store(tmp_path)
    url = store.url
    ls = run_cli("snapshot", "ls", url, "--json", timeout=60)
    assert ls.returncode == 0, ls.stderr[-2000:]
    assert [e["step"] for e in json_lines(ls)] == [1, 2] and all(e["complete"] for e in json_lines(ls))
    inspect = run_cli("snapshot", "inspect", f"{url}@1", "--json", timeout=60)
    lines = json_lines(inspect)
    assert inspect.returncode == 0 and len(lines) == 1
    m = store.read_record(1).manifest
    assert lines[0]["step"] == 1 and lines[0]["state_hash"] == m.state_hash()
    assert lines[0]["manifest_hash"] == m.manifest_hash()
    assert lines[0]["cursor"]["blocks_applied"] == 0 and lines[0]["spec"]["run_id"] == "cli-run"
    assert lines[0]["spec"]["hparams"]["total_steps"] == 20 and lines[0]["spec_hash"] == spec.spec_hash()
    verified = Recorder()  # in-process (each `node` process costs seconds of imports): a clean store verifies
    assert run_command(SimpleNamespace(command="snapshot", snapshot_command="verify", store=url), verified) == 0
    assert [(e["step"], e["ok"]) for e in verified.events] == [(1, True), (2, True)]
    # flip a byte of a chunk only the newest snapshot holds
    victim = sorted(set(store.read_record(2).manifest.chunks) - set(m.chunks))[0]
    path = tmp_path / "store" / "chunks" / victim
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    verify = run_cli("snapshot", "verify", url, "--json", timeout=60)
    assert verify.returncode == 5 and "Traceback" not in verify.stderr
    by_step = {e["step"]: e for e in json_lines(verify) if e["event"] == "verified"}
    assert by_step[1]["ok"] and not by_step[2]["ok"] and "corrupt" in by_step[2]["faults"][0]
    # resuming the newest (corrupt) snapshot is refused, nothing is overwritten
    resume = run_cli("join", "cli-run", "--resume-from", url, "--state-dir", str(tmp_path / "owner"), "--json",
                     timeout=60)
    assert resume.returncode == 5 and "corrupt" in json_lines(resume)[-1]["message"]
    assert path.read_bytes() == bytes(raw)


def test_export_and_import_roundtrip(tmp_path):
    store, _, _ = make_store(tmp_path, steps=(3,))
    out = tmp_path / "w.safetensors"
    exported = run_cli("snapshot", "export", store.url, "--to", str(out), "--json", timeout=60)
    assert exported.returncode == 0, exported.stderr[-2000:]
    from safetensors.torch import load_file

    weights = load_file(str(out))
    frozen = store.load().frozen
    assert set(weights) == {n[len("model/"):] for n in frozen.tensors() if n.startswith("model/")}
    assert all(torch.equal(weights[n[6:]], t) for n, t in frozen.tensors().items() if n.startswith("model/"))
    # a plain torch checkpoint of the same task moves in as a new run's snapshot
    task = SyntheticTask({}, 7)
    model = task.build_model()
    opt = task.build_optimizer(model, {**SyntheticTask.hparam_defaults})
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    ckpt = tmp_path / "my-run.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5}, ckpt)
    imported = run_cli("snapshot", "import", str(ckpt), "--task", "synthetic", "--to", str(tmp_path / "moved"),
                       "--state-dir", str(tmp_path / "owner"), "--json", timeout=60)
    assert imported.returncode == 0, imported.stderr[-2000:]
    event = json_lines(imported)[-1]
    assert event["event"] == "imported" and event["run_id"] == "my-run" and event["step"] == 5
    moved = SnapshotStore(str(tmp_path / "moved")).load()
    tensors = moved.frozen.tensors()
    assert all(torch.equal(tensors[f"model/{k}"], v) for k, v in model.state_dict().items())
    assert torch.equal(tensors["optimizer/0/exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"nope": torch.zeros(2)}}, bad)
    args = SimpleNamespace(command="snapshot", snapshot_command="import", checkpoint=str(bad), task="synthetic",
                           to=str(tmp_path / "x"), run_id=None, sets=[], seed=None, state_dir=str(tmp_path / "owner"))
    with pytest.raises(IncompatibleState, match="does not fit"):  # exit 5
        run_command(args, Recorder())
    assert not (tmp_path / "x").exists()


def test_resume_plan_amends_only_as_owner_and_only_hparams(tmp_path):
    store, key, spec = make_store(tmp_path, steps=(2,))
    plan = plan_resume(store.url, run_id="cli-run", sets={"lr": "0.5", "total_steps": "40"}, key=key)
    assert plan.signed.spec.total_steps == 40 and plan.signed.spec.hparams["lr"] == 0.5
    amendment = Amendment.decode(plan.history[-1])
    assert amendment.from_spec == spec.spec_hash() and amendment.to_spec == plan.signed.spec.spec_hash()
    assert amendment.step == 2 and amendment.changes == {"lr": 0.5, "total_steps": 40}
    task = SyntheticTask(dict(plan.signed.spec.task_args), plan.signed.spec.seed)
    state = initial_state(plan.signed.spec, task, "cpu")
    apply_resume(state, plan)
    assert state.step == 2 and state.spec_hash == plan.signed.spec.spec_hash()
    factor = state.scheduler.lr_lambdas[0](state.scheduler.last_epoch)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * factor)
    with pytest.raises(AccessRefused):
        plan_resume(store.url, run_id="cli-run", sets={"lr": "0.5"}, key=ensure_identity(tmp_path / "intruder")[1])
    for bad in ({"block_size": "4"}, {"num_examples": "3"}):
        with pytest.raises(UsageError):
            plan_resume(store.url, run_id="cli-run", sets=bad, key=key)
    with pytest.raises(IncompatibleState, match="not 'other-run'"):
        plan_resume(store.url, run_id="other-run", sets={}, key=key)
    # a snapshot of another spec than the one it carries (foreign state) is refused
    other, _, _ = make_store(tmp_path / "b", run_id="cli-run", steps=(2,))
    record_path = tmp_path / "store" / "snapshots" / "000000000002.snapshot"
    from swarmrun.protocol.snapshot import SnapshotRecord

    rec = SnapshotRecord.decode(record_path.read_bytes())
    foreign = SnapshotRecord(manifest=rec.manifest, signed_spec=other.read_record(2).signed_spec)
    record_path.write_bytes(foreign.encode())
    with pytest.raises(IncompatibleState, match="foreign"):
        plan_resume(store.url, run_id="cli-run", sets={}, key=key)
