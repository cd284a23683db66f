"""The CLI's --json output and exit codes, bad input included (no traceback, the documented code)."""

import json

import pytest

from tests.swarm_helpers import Swarm, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # real peers: more than the default 60 s


def last_event(result):
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert lines, result.stderr[-2000:]
    return lines[-1]


def test_help_lists_exit_codes():
    result = run_cli("join", "--help")
    assert result.returncode == 0
    assert "exit codes" in result.stdout and "--max-steps" in result.stdout


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["join", "r1", "--task", "nope"], 2, "not installed"),
        (["join", "r1", "--task", "synthetic", "--set", "novalue"], 2, "KEY=VALUE"),
        (["join", "r1", "--task", "synthetic", "--set", "bogus=1"], 2, "unknown --set"),
        (["join", "r1", "--task", "synthetic", "--set", "lr=fast"], 2, "lr"),
        (["join", "r1"], 2, "--task"),
        (["join", "bad/id", "--task", "synthetic"], 2, "run id"),
        (["join", "r1", "--peers", "not-a-multiaddr"], 2, "multiaddr"),
        (["join", "r1", "--peers", "/ip4/127.0.0.1/tcp/31337"], 2, "no /p2p/ part"),  # was p2pd's own text, exit 1
        (["join", "r1", "--task", "synthetic", "--device", "cuda:7"], 2, "cuda"),
    ],
)
def test_bad_input_is_a_usage_error(tmp_path, args, code, words):
    result = run_cli(*args, "--state-dir", str(tmp_path / "s"), "--json", timeout=90)
    assert result.returncode == code, (result.stdout, result.stderr[-2000:])
    event = last_event(result)
    assert event["event"] == "error" and event["code"] == code
    assert words.lower() in event["message"].lower()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("reuseport", [False, True])
def test_busy_port_is_a_usage_error(tmp_path, reuseport):
    """``reuseport``: the port is held the way another peer's p2pd holds it (SO_REUSEPORT, which let a second peer
    share it silently)."""
    import socket

    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("join", "r1", "--task", "synthetic", "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                         "--state-dir", str(tmp_path / "s"), "--json", timeout=90)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert "listen" in last_event(result)["message"]


def test_unreachable_peer_is_exit_3(tmp_path):
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/QmSM14zffYVKVkDgXfxw5DHsNCHBvcDr1tid6F9YJ2KwMA"
    result = run_cli("join", "r1", "--peers", maddr, "--state-dir", str(tmp_path / "s"), "--json", timeout=120)
    assert result.returncode == 3, (result.stdout, result.stderr[-2000:])
    error = last_event(result)
    assert error["event"] == "error" and "none answered" in error["message"]
    assert "Daemon" not in error["message"] and "bootstrap" not in error["message"]  # not the daemon's own text


def test_existing_and_missing_runs_and_another_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello swarm " * 400)
    with Swarm(tmp_path, "cli-run") as swarm:
        swarm.create("p0", "--task", "char-lm", "--set", f"corpus={corpus}", "--set", "d_model=32",
                     "--set", "n_layer=1", "--set", "total_steps=1000", "--min-peers", "5")
        state = lambda n: str(tmp_path / n)  # noqa: E731
        # the run exists: creating it again at these peers is refused
        again = run_cli("join", "cli-run", "--task", "synthetic", "--peers", swarm.maddr, "--state-dir", state("x1"), "--json")
        assert again.returncode == 2 and "already exists" in last_event(again)["message"]
        # another run id is not found
        missing = run_cli("join", "no-such-run", "--peers", swarm.maddr, "--state-dir", state("x2"), "--json")
        assert missing.returncode == 3 and "not found" in last_event(missing)["message"]
        # status sees the run and its peer
        status = run_cli("status", "cli-run", "--peers", swarm.maddr, "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        st = last_event(status)
        assert st["event"] == "status" and st["task"] == "char-lm" and len(st["peers"]) == 1
        # ... and what it serves: the state of its step, which joiners fetch
        assert [p["peer_id"] for p in st["providers"]] == [st["peers"][0]["peer_id"]]
        assert st["providers"][0]["state_hash"] == st["peers"][0]["state_hash"] and st["providers"][0]["mib"] > 0
        # a joiner whose corpus differs from the run's is refused with exit 5
        (corpus / "a.txt").write_text("another corpus " * 400)
        other = run_cli("join", "cli-run", "--peers", swarm.maddr, "--state-dir", state("x3"), "--json")
        assert other.returncode == 5, (other.stdout, other.stderr[-2000:])
        assert "corpus" in last_event(other)["message"]
        # the same identity (state dir) as a live peer is refused
        twin = run_cli("join", "cli-run", "--peers", swarm.maddr, "--state-dir", state("p0"), "--json")
        assert twin.returncode == 2 and "identity" in last_event(twin)["message"]


def test_max_steps_then_exit_0_and_left_event(tmp_path):
    result = run_cli("join", "solo", "--task", "synthetic", "--max-steps", "3", "--state-dir", str(tmp_path / "s"),
                     "--device", "cpu", "--json", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["event"] == "listening" and events[0]["maddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
    left = events[-1]
    assert left["event"] == "left" and left["reason"] == "max_steps" and left["step"] == 3


def test_library_api_example_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "existing_loop.py"
    result = subprocess.run([sys.executable, str(example), "--create", "--state-dir", str(tmp_path / "s"),
                             "--max-steps", "3"], capture_output=True, text=True, timeout=120, start_new_session=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "left the run: max_steps" in result.stdout
