"""Bootstrap and catch-up with real peers: many providers (a keeper, a lying one), a swarm faster than the transfer."""

import signal
import time

import pytest

from tests.swarm_helpers import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s

LONG_RUN = ("--set", "total_steps=100000", "--set", "hidden=256", "--matchmaking-time", "1.0")


def _leave_all(swarm) -> None:
    """SIGTERM every peer (a graceful leave) and wait for each to exit cleanly."""
    for peer in swarm.peers.values():
        peer.kill_group(signal.SIGTERM)
    for name in swarm.peers:
        assert swarm.wait_exit(name, timeout=120) == 0, swarm.log(name)[-3000:]


def _wait_held(swarm, name: str, step: int, timeout: float) -> None:
    """Wait until peer ``name`` holds a state of ``step`` or later (bootstrapped, re-synced or committed)."""
    deadline = time.monotonic() + timeout
    while not any(e["step"] >= step for kind in ("bootstrapped", "resync", "step") for e in swarm.events(name, kind)):
        assert time.monotonic() < deadline, f"{name} held no state of step >= {step} within {timeout}s: " \
                                            f"{swarm.log(name)[-2000:]}"
        time.sleep(0.2)


def _assert_one_state_per_step(swarm) -> dict:
    by_step: dict = {}
    for name in swarm.peers:
        for kind in ("step", "resync", "bootstrapped", "left"):
            for e in swarm.events(name, kind):
                by_step.setdefault(e["step"], {})[name] = e["state_hash"]
    for step, by_peer in by_step.items():
        assert len(set(by_peer.values())) == 1, (step, by_peer)
    return by_step


def test_joiner_bootstraps_from_several_providers_despite_a_liar(tmp_path):
    with Swarm(tmp_path, "boot") as swarm:
        swarm.create("p0", "--task", "synthetic", *LONG_RUN, "--set", "chunk_size=1024", "--min-peers", "2")
        swarm.join("liar", "--matchmaking-time", "1.0", env={"SWARMRUN_FAULTS": "corrupt@serve:step=0"})
        swarm.start_keeper("keeper")
        swarm.wait_for("keeper", "bootstrapped", timeout=180)
        first = swarm.wait_for("p0", "step", timeout=120)["step"]
        swarm.wait_for("p0", "step", timeout=120, step=first + 3)  # a state worth fetching (replay is dearer)
        swarm.join("late", "--matchmaking-time", "1.0")
        boot = swarm.wait_for("late", "bootstrapped", timeout=180)
        # three providers announced the state; the liar's chunks did not verify, the others served it
        assert boot["fetched"] >= 1 and boot["step"] >= 3, boot
        assert boot["providers"] >= 1 and boot["bytes"] > 0, boot
        swarm.wait_for("late", "step", timeout=120)  # it trains in the swarm after the bootstrap
        # the keeper keeps up: it follows the swarm a re-sync at a time, so it may be a step or two behind at any one
        # moment (CI: it left at 47 right after the joiner bootstrapped at 48), but it reaches the joiner's step
        _wait_held(swarm, "keeper", boot["step"], timeout=120)
        _leave_all(swarm)
        _assert_one_state_per_step(swarm)
        assert [e for e in swarm.events("keeper", "left")][0]["step"] >= boot["step"]
        # whoever asked the liar for chunks caught it (and it never got a corrupt state in)
        banned = sum(e.get("banned", 0) for n in ("keeper", "late") for e in swarm.events(n, "bootstrapped")
                     + swarm.events(n, "resync"))
        assert banned >= 1 or "lied" not in (tmp_path / "late.log").read_text() + (tmp_path / "keeper.log").read_text()


def test_swarm_faster_than_the_transfer_still_admits_the_joiner(tmp_path):
    # the providers hold back a state's last chunk until they stepped twice past it: the swarm is faster than the
    # transfer by construction (a test that hoped for it once failed when the transfer won the race)
    slow = {"SWARMRUN_FAULTS": "hold@serve:steps=2"}
    with Swarm(tmp_path, "fast") as swarm:
        swarm.create("p0", "--task", "synthetic", *LONG_RUN, "--set", "chunk_size=512", "--min-peers", "2", env=slow)
        swarm.join("p1", "--matchmaking-time", "1.0", env=slow)
        first = swarm.wait_for("p0", "step", timeout=120)["step"]
        swarm.wait_for("p0", "step", timeout=120, step=first + 3)
        swarm.join("late", "--matchmaking-time", "1.0")
        boot = swarm.wait_for("late", "bootstrapped", timeout=180)
        # the swarm stepped while the state travelled; the joiner replayed step records instead of starting over
        assert boot["fetched"] == 1 and boot["replayed"] >= 1, boot
        # and it keeps up (invariant 3): it reaches steps the swarm took after it bootstrapped, in a round of its
        # own or by re-syncing. Which of the two is timing (a joiner whose first round forms after the others'
        # waits out its averaging timeout, then re-syncs: issue 18), so the test does not ask for a round.
        target = swarm.events("p0", "step")[-1]["step"] + 2
        deadline = time.monotonic() + 120
        while not any(e["step"] >= target for kind in ("step", "resync") for e in swarm.events("late", kind)):
            assert time.monotonic() < deadline and swarm.peers["late"].alive, swarm.log("late")
            time.sleep(0.2)
        _leave_all(swarm)
        _assert_one_state_per_step(swarm)


def test_sigint_to_the_joiners_pid_alone_stops_it_while_it_bootstraps(tmp_path):
    """A supervisor signals the peer's pid, not its group (issue 19: such a SIGINT was ignored during bootstrap,
    since starting hivemind's averager set SIGINT to "ignore"). The providers hold their state's last chunk for
    half a chunk timeout (10 s), which keeps the joiner in its bootstrap when the signal comes."""
    held = {"SWARMRUN_FAULTS": "hold@serve:steps=1000000"}
    with Swarm(tmp_path, "held") as swarm:
        swarm.create("p0", "--task", "synthetic", *LONG_RUN, "--set", "chunk_size=512", "--min-peers", "2", env=held)
        swarm.join("p1", "--matchmaking-time", "1.0", env=held)
        swarm.wait_for("p0", "step", timeout=120)
        swarm.join("late", "--matchmaking-time", "1.0")
        swarm.wait_for("late", "transfer_progress", timeout=120)
        swarm.peers["late"].proc.send_signal(signal.SIGINT)
        assert swarm.wait_exit("late", timeout=30) == 0
        assert swarm.events("late", "left_early") and not swarm.events("late", "bootstrapped"), swarm.log("late")
