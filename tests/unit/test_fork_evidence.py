"""A split's minority that fell behind the majority's history: before a state ahead replaces its own steps, it reads
the swarm's step record from its step; one that starts from another state is the evidence that its steps since its
last majority commit are discarded, and they are counted (issue 14: a 3-peer namespace run re-synced its 22 solo
steps away with ``discarded`` 0)."""

import asyncio
from types import SimpleNamespace

from swarmrun.node.peer import catchup as catchup_mod
from swarmrun.node.peer.catchup import CatchUp
from swarmrun.protocol.round import SwarmView
from swarmrun.protocol.transfer import ProviderRecord

MINE, THEIRS = "a" * 64, "b" * 64


def _catch_up(monkeypatch, *, record_starts_from: str, anchor=(38, "c" * 64), log=None):
    fetched = []

    async def fetch(manifest_hash, sources, *, deadline):
        fetched.append(manifest_hash)
        return "record", None

    monkeypatch.setattr(catchup_mod, "read_step_record", lambda record: ([], None, record_starts_from, "d" * 64))
    served = SimpleNamespace(position=(61, MINE, anchor), fetcher=SimpleNamespace(fetch=fetch))
    up = CatchUp(dht=None, spec=None, config=None, events=None, peer_id="QmMe", state=SimpleNamespace(step=61),
                 served=served, reporter=SimpleNamespace(view=SwarmView(reports={})), stop_requested=asyncio.Event(),
                 replay=None, record_bytes=1)
    records = {"QmMajority": ProviderRecord(step=100, manifest_hash="m" * 64, state_hash=THEIRS, total_bytes=1, time=0.0,
                                            log=log if log is not None else {61: "r" * 64, 62: "s" * 64})}
    return up, records, fetched


def test_a_minority_behind_the_majority_counts_the_steps_a_state_ahead_discards(monkeypatch):
    up, records, fetched = _catch_up(monkeypatch, record_starts_from=THEIRS)
    asyncio.run(up._check_fork(records, deadline=1e12))
    assert fetched == ["r" * 64]  # the record of the swarm's step 61 -> 62
    assert up._discarded(100) == 61 - 38  # its steps since its last majority commit
    asyncio.run(up._check_fork(records, deadline=1e12))
    assert fetched == ["r" * 64]  # read once per state


def test_a_peer_the_swarm_went_on_from_discards_nothing(monkeypatch):
    up, records, fetched = _catch_up(monkeypatch, record_starts_from=MINE)  # the swarm's history went through its state
    asyncio.run(up._check_fork(records, deadline=1e12))
    assert fetched and up._discarded(100) == 0


def test_no_record_read_when_there_is_nothing_to_lose_or_no_record(monkeypatch):
    up, records, fetched = _catch_up(monkeypatch, record_starts_from=THEIRS, anchor=(61, MINE))  # a majority commit
    asyncio.run(up._check_fork(records, deadline=1e12))
    up2, records2, fetched2 = _catch_up(monkeypatch, record_starts_from=THEIRS, log={90: "r" * 64})  # none at 61
    asyncio.run(up2._check_fork(records2, deadline=1e12))
    assert not fetched and not fetched2
    assert up._discarded(100) == 0 and up2._discarded(100) == 0  # no evidence, none counted
