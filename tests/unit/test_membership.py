"""The run's membership as a peer remembers it (``Reporter.members``/``vanished``): what the split rules count."""

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.peer import reporter as reporter_mod
from swarmrun.node.peer.reporter import Reporter
from swarmrun.node.peer.trainer import TrainerConfig
from swarmrun.protocol.round import ProgressReport, Role, SwarmView


def rep(step=3, *, left=False, finished=False, role=Role.TRAINER, joining=None):
    return ProgressReport(step=step, samples=0, samples_per_second=1.0, role=role, state_hash="h", time=0.0,
                          left=left, finished=finished, joining=joining)


def make(view: dict) -> Reporter:
    r = Reporter(dht=None, spec=None, gate=None, config=TrainerConfig(), peer_id="me", subkey=b"",
                 report=lambda: rep(), provider_record=lambda: None, on_tick=lambda: None)
    r.view = SwarmView(reports={"me": rep(), **view})
    r.recently_live()
    return r


def test_a_trainer_that_vanished_is_remembered_one_that_left_is_not():
    r = make({"a": rep(), "b": rep(), "k": rep(role=Role.KEEPER)})
    assert r.members() == 3 and r.vanished(60.0) == 0  # a keeper is no trainer
    r.view = SwarmView(reports={"me": rep(), "b": rep(left=True)})  # a vanished (crash or partition), b said it left
    r.recently_live()
    assert r.members() == 2 and r.vanished(60.0) == 1
    r.view = SwarmView(reports={"me": rep()})
    r.recently_live()
    assert r.members() == 2 and r.vanished(60.0) == 1  # b's last report said it left: never counted again


def test_vanished_trainers_are_forgotten_after_the_window(monkeypatch):
    r = make({"a": rep(), "f": rep()})
    r.view = SwarmView(reports={"me": rep(), "f": rep(finished=True)})
    r.recently_live()
    assert r.vanished(60.0) == 1
    later = time.monotonic() + 61.0
    monkeypatch.setattr(reporter_mod.time, "monotonic", lambda: later)
    assert r.vanished(60.0) == 0  # gone longer than alone_after: this peer may step alone
    assert r.members() == 2  # ... but its steps alone are not a majority of the membership until it forgets a
    later += reporter_mod.MEMBERSHIP_MEMORY
    assert r.members() == 1


def test_a_trainer_waiting_for_the_step_it_asked_for_leaves_this_peer_alone():
    """The trainer's "alone" (the solo commit, a round giving up) is ``recently_live``: a trainer that waits for a later
    step it asked for is not counted (a creator and its only joiner waited 60 s for each other), and one whose report
    a read missed still is, for the report TTL (a view-based test let two peers commit alone at once)."""
    r = make({"joiner": rep(16, joining=18)})
    assert r.recently_live() == 1
    # ... until this peer stands at the step the joiner asked for: there it is planned in, and live (counted nowhere,
    # a creator whose solo steps were shorter than a catch-up committed every step alone while its joiners chased it)
    r.view = SwarmView(reports={"me": rep(18), "joiner": rep(16, joining=18)})
    assert r.recently_live() == 2
    r = make({"b": rep(16)})
    r.view = SwarmView(reports={"me": rep()})  # b's report missed by one read
    assert r.recently_live() == 2


def test_a_newcomer_is_not_alone_before_it_watched_the_run_for_a_report_ttl(monkeypatch):
    """CI: a joiner's first reads missed the creator's report, it committed step 1 alone and split the run. A
    newcomer that sees no other trainer neither steps nor counts as alone until it read the run for a report TTL."""
    r = make({})
    assert r.alone() and not r.watching()  # a creator (or a resumed run) alone: nobody else holds the run
    r.newcomer = True
    assert r.watching() and not r.alone()  # no read yet
    seen = {}

    async def read_view(dht, run_id, gate):
        return SwarmView(reports=seen)

    monkeypatch.setattr(reporter_mod, "read_view", read_view)
    r.spec = type("S", (), {"run_id": "run"})()
    asyncio.run(r.refresh())  # a read that found no other trainer
    assert r.watching() and not r.alone()
    seen["other"] = rep()
    asyncio.run(r.refresh())
    assert not r.watching() and not r.alone()  # it sees another trainer: it is in the run's rounds
    later = time.monotonic() + TrainerConfig().report_ttl + 1
    monkeypatch.setattr(reporter_mod.time, "monotonic", lambda: later)
    seen.clear()
    asyncio.run(r.refresh())
    assert not r.watching() and r.alone()  # gone for a report TTL, watched for longer: it may step alone


def keeper(step, *, left=False, age=0.0):
    return replace(rep(step, role=Role.KEEPER, left=left), time=get_dht_time() - age)


def test_a_stopped_trainer_serves_a_keeper_that_is_behind_until_it_caught_up(monkeypatch):
    """CI's pool trace: both trainers of a run left 0.1 s after a step their keeper had not replayed; the next worker
    joined the keeper three committed steps behind. A stopped trainer keeps announcing its state (bounded) while a
    live keeper reports an older step."""
    r = make({"k": keeper(10)})
    r.config, r.dht = TrainerConfig(report_interval=0.01), SimpleNamespace(is_alive=lambda: True)
    views = iter([{"k": keeper(12)}, {"k": keeper(13)}])
    published = []

    async def publish():
        published.append(1)

    def refresh_to(reports):
        async def refresh():
            r.view = SwarmView(reports={"me": rep(13), **reports()})
        return refresh

    monkeypatch.setattr(r, "publish", publish)
    monkeypatch.setattr(r, "refresh", refresh_to(lambda: next(views, {"k": keeper(13)})))
    assert asyncio.run(r.hand_to_keepers(13, within=5.0))
    assert len(published) == 2  # announced until the keeper reported step 13
    r.view = SwarmView(reports={"k": keeper(5)})
    monkeypatch.setattr(r, "refresh", refresh_to(lambda: {"k": keeper(5), "gone": keeper(1, left=True)}))
    assert not asyncio.run(r.hand_to_keepers(13, within=0.1))  # bounded: a keeper that never catches up
    assert len(published) > 2
    published.clear()
    r.view = SwarmView(reports={"gone": keeper(1, left=True), "t": rep(2), "dead": keeper(5, age=6.0)})
    assert asyncio.run(r.hand_to_keepers(13, within=5.0)) and not published  # no keeper live and behind: no DHT call
    r.view, r.dht = SwarmView(reports={"k": keeper(5)}), SimpleNamespace(is_alive=lambda: False)
    assert not asyncio.run(r.hand_to_keepers(13, within=5.0)) and not published  # its DHT died: nothing to serve with


def test_the_trainers_that_vanished_are_pinged_once_per_report_ttl():
    """``Reporter.reconnect`` (hivemind forgets a node that did not answer; after a partition's heal the sides never
    met again): the trainers pinged are those of the membership not in the view, not one that said it left, and a
    ping goes out once per report TTL."""
    r = make({"a": rep(), "b": rep(), "c": rep()})
    calls = []

    class DHTStub:
        def run_coroutine(self, fn, return_future=False):
            calls.append(sorted(fn.keywords["peer_ids"]))
            future = asyncio.get_running_loop().create_future()
            future.set_result(fn.keywords["peer_ids"][:1])
            return future

    r.dht = DHTStub()
    r.view = SwarmView(reports={"me": rep(), "c": rep(left=True)})
    r.recently_live()
    assert r.lost() == ["a", "b"]

    async def ticks():
        for _ in range(3):
            r._reconnect_due()
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    asyncio.run(ticks())
    assert calls == [["a", "b"]]
    r.view = SwarmView(reports={"me": rep(), "a": rep(), "b": rep()})
    r.recently_live()
    assert r.lost() == []


def test_reports_follow_the_steps_length_within_the_interval_and_a_quarter_ttl():
    """Every report_interval while steps are short or unknown; a quarter of a step when steps are long (outer
    mode); never less often than four times a report TTL (a live peer must not look gone)."""
    seconds = {"step": None}
    config = TrainerConfig(report_interval=0.5, report_ttl=8.0)
    r = Reporter(dht=None, spec=None, gate=None, config=config, peer_id="me", subkey=b"", report=lambda: rep(),
                 provider_record=lambda: None, on_tick=lambda: None, step_seconds=lambda: seconds["step"])
    assert r.interval() == 0.5  # before two commits
    for step, interval in ((0.6, 0.5), (2.0, 0.5), (4.0, 1.0), (8.0, 2.0), (120.0, 2.0)):
        seconds["step"] = step
        assert r.interval() == interval, step
    r.config = TrainerConfig(report_interval=3.0, report_ttl=8.0)  # an interval set above a quarter TTL stays as set
    assert r.interval() == 3.0
