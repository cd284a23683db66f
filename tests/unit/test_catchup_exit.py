"""A joiner that cannot get the swarm's state in time (its providers replaced what they announced faster than it
could be fetched, or went away) fails with exit 3 and says so; exit 5 is for a state that did not verify (issue 14:
a fast swarm's joiner exited 5 "no provider sent the manifest")."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from swarmrun.node.net.fetch import FetchFailed
from swarmrun.node.peer import catchup as catchup_mod
from swarmrun.node.peer.catchup import CatchUp
from swarmrun.protocol.errors import CatchUpFailed, IncompatibleState
from swarmrun.protocol.round import ProgressReport, Role, SwarmView
from swarmrun.protocol.transfer import ProviderRecord

HASH = "a" * 64


def _catch_up(monkeypatch, fetch_error: Exception) -> CatchUp:
    provider = ProviderRecord(step=50, manifest_hash="m" * 64, state_hash=HASH, total_bytes=1000, time=0.0)

    async def providers(dht, run_id, gate):
        return {"QmProvider": provider}

    monkeypatch.setattr(catchup_mod, "read_providers", providers)

    async def nothing():
        return None

    async def fetch(*args, **kwargs):
        raise fetch_error

    view = SwarmView(reports={"QmProvider": ProgressReport(step=50, samples=0, samples_per_second=70.0,
                                                          role=Role.TRAINER, state_hash=HASH, time=0.0)})
    served = SimpleNamespace(start=nothing, state_hash="0" * 64, gate=None, anchor=None, position=(0, "0" * 64, None),
                             fetcher=SimpleNamespace(fetch=fetch, banned=set(), partials={}))
    return CatchUp(dht=SimpleNamespace(is_alive=lambda: True), spec=SimpleNamespace(run_id="r"),
                   config=SimpleNamespace(report_interval=0.01, state_timeout=0.3), events=None, peer_id="QmMe",
                   state=SimpleNamespace(step=0), served=served, reporter=SimpleNamespace(view=view, refresh=nothing),
                   stop_requested=asyncio.Event(), replay=lambda grads, applied: None, record_bytes=10**6)


def test_a_state_replaced_faster_than_it_is_fetched_is_exit_3_with_what_happened(monkeypatch):
    gone = FetchFailed("could not fetch mmmm from 1 provider(s): no provider sent the manifest (unreachable, refused, "
                       "or it did not match the announced hash)")
    up = _catch_up(monkeypatch, gone)
    with pytest.raises(CatchUpFailed) as caught:
        asyncio.run(up.catch_up(deadline=time.monotonic() + 0.3))
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "could not catch up with the swarm" in message and "no provider sent the manifest" in message


def test_a_state_that_does_not_verify_is_exit_5(monkeypatch):
    up = _catch_up(monkeypatch, IncompatibleState("state of step 50 does not verify: state_hash"))
    with pytest.raises(IncompatibleState) as caught:
        asyncio.run(up.catch_up(deadline=time.monotonic() + 0.3))
    assert not isinstance(caught.value, CatchUpFailed) and caught.value.exit_code == 5
