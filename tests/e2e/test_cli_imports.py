"""Commands that need no swarm do not import hivemind, and a usage error comes before torch (issue 19: every
mistyped value took 2.4-5 s); `node identity show` prints the peer id without --json."""

import json
import subprocess
import sys

import pytest

from tests.swarm_helpers import run_cli

pytestmark = pytest.mark.e2e

PROBE = ("import json, sys\n"
         "from swarmrun.node.cli.main import main\n"
         "rc = main(sys.argv[1:])\n"
         "print(json.dumps(dict(rc=rc, loaded=sorted({'torch', 'hivemind'} & set(sys.modules)))), file=sys.stderr)\n")


def loaded_by(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ("join", "r", "--task", "synthetic", "--batch-size", "0"),
    ("join", "r", "--task", "synthetic", "--matchmaking-time", "0"),
    ("join", "r", "--epochs", "-1"),
    ("status", "not a run id!"),
])
def test_a_usage_error_imports_neither_torch_nor_hivemind(argv):
    assert loaded_by(*argv) == dict(rc=2, loaded=[])


def test_snapshot_inspect_needs_no_hivemind(tmp_path):
    result = loaded_by("snapshot", "inspect", str(tmp_path / "missing"))
    assert result["rc"] != 0 and "hivemind" not in result["loaded"], result


def test_identity_show_prints_the_peer_id_first_without_json(tmp_path):
    shown = json.loads(run_cli("identity", "show", "--state-dir", str(tmp_path), "--json").stdout.splitlines()[-1])
    human = run_cli("identity", "show", "--state-dir", str(tmp_path)).stdout.splitlines()
    assert human[0] == shown["peer_id"] and human[0].startswith("Qm")
