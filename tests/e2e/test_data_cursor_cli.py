"""Bad input to the data cursor at the CLI: a snapshot whose cursor counts other data is refused (exit 5)."""

import json

import pytest

from swarmrun.node.peer.build import initial_state, make_spec
from swarmrun.node.state.store import SnapshotStore
from swarmrun.node.net.swarm import ensure_identity, public_key_bytes
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.spec import SignedSpec
from tests.swarm_helpers import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # real peers: more than the default 60 s


def test_resume_refuses_a_snapshot_whose_cursor_counts_other_data(tmp_path):
    key = ensure_identity(tmp_path / "owner")[1]
    spec, task = make_spec(run_id="cursor-run", task_cls=SyntheticTask, sets={"total_steps": "20"}, seed=7,
                           owner_key=public_key_bytes(key))
    signed = SignedSpec.sign(spec, key.sign).encode()
    good = initial_state(spec, task, "cpu").cursor
    assert good.data_fingerprint == spec.data_fingerprint and good.num_examples == 4096
    cursors = {
        "size": DataCursor.new(seed=7, num_examples=4000, block_size=8, data_fingerprint=spec.data_fingerprint),
        "control": good.apply(range(3)),
    }
    results = {}
    for name, cursor in cursors.items():
        state = initial_state(spec, task, "cpu")
        state.step, state.cursor = 1, cursor
        store = SnapshotStore(str(tmp_path / name))
        store.write(state.freeze(chunk_size=1 << 16), signed_spec=signed)
        results[name] = run_cli("join", "cursor-run", "--resume-from", store.url, "--state-dir", str(tmp_path / "owner"),
                                "--device", "cpu", "--max-steps", "1", "--json", timeout=120)
    # (a cursor of another fingerprint or seed is refused by the same check: tests/unit/test_protocol_cursor.py)
    for name, fragment in (("size", "4000 examples"),):
        r = results[name]
        last = json.loads(r.stdout.splitlines()[-1])
        assert r.returncode == 5 and last["event"] == "error" and "data cursor" in last["message"], (name, r.stdout, r.stderr[-2000:])
        assert fragment in last["message"] and "Traceback" not in r.stderr
    # the same snapshot with this dataset's cursor resumes (and leaves at --max-steps 1 at once)
    control = results["control"]
    assert control.returncode == 0, control.stderr[-3000:]
    left = [json.loads(line) for line in control.stdout.splitlines() if '"left"' in line][-1]
    assert left["reason"] == "max_steps" and left["cursor"]["blocks_applied"] == 3
