"""State transfer on loopback: real DHTs and p2pds, a joiner fetching one state from several providers."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind import DHT

from swarmrun.node.state.run import FrozenState
from swarmrun.node.net.fetch import Fetcher, FetchFailed
from swarmrun.node.net.serve import StateServer, admit_open
from swarmrun.protocol.manifest import build_manifest

pytestmark = pytest.mark.timeout(300)  # real peers: more than the default 60 s

SPEC = "a" * 64


def _state(nbytes: int = 3 * 2**20 + 123, chunk_size: int = 1 << 18) -> FrozenState:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()
    view = memoryview(bytearray(data))
    half = nbytes // 2
    manifest = build_manifest(spec_hash=SPEC, step=7, chunk_size=chunk_size, content={},
                              tensors=[("model/a", "uint8", (half,), view[:half]),
                                       ("model/b", "uint8", (nbytes - half,), view[half:])])
    return FrozenState(manifest=manifest, data=view.toreadonly())


class _Corrupt(FrozenState):
    """A provider that serves wrong bytes for every chunk (its manifest is the honest one)."""

    def chunk(self, index: int) -> memoryview:
        data = bytearray(super().chunk(index))
        data[0] ^= 0xFF
        return memoryview(bytes(data))


@pytest.fixture
async def swarm():
    dhts = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    maddrs = [str(m) for m in dhts[0].get_visible_maddrs()]
    dhts += [DHT(start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(3)]
    p2ps = [await d.replicate_p2p() for d in dhts]
    try:
        yield dhts, p2ps
    finally:
        for d in dhts:
            d.shutdown()


async def _serve(p2p, frozen, **kwargs) -> StateServer:
    server = StateServer(p2p, "run", admit_open(SPEC), **kwargs)
    await server.start()
    server.publish_state(frozen)
    return server


async def test_fetch_from_three_providers_verifies(swarm):
    dhts, p2ps = swarm
    frozen = _state()
    servers = [await _serve(p, frozen) for p in p2ps[1:]]
    fetcher = Fetcher(p2ps[0], "run", SPEC, chunk_timeout=10)
    got, stats = await fetcher.fetch(frozen.manifest.manifest_hash(), [d.peer_id.to_base58() for d in dhts[1:]],
                                     deadline=time.monotonic() + 60)
    assert bytes(got.data) == bytes(frozen.data)
    assert got.faults() == []
    assert got.manifest.state_hash() == frozen.manifest.state_hash()
    assert stats.bytes == frozen.manifest.total_bytes
    assert sum(1 for b in stats.by_provider.values() if b > 0) >= 2  # the queue is shared
    assert sum(s.bytes_served for s in servers) >= frozen.manifest.total_bytes


async def test_corrupt_provider_is_banned_and_state_still_verifies(swarm):
    dhts, p2ps = swarm
    frozen = _state()
    liar = _Corrupt(manifest=frozen.manifest, data=frozen.data)
    await _serve(p2ps[1], liar)
    await _serve(p2ps[2], frozen)
    fetcher = Fetcher(p2ps[0], "run", SPEC, chunk_timeout=10)
    peers = [dhts[1].peer_id.to_base58(), dhts[2].peer_id.to_base58()]
    got, stats = await fetcher.fetch(frozen.manifest.manifest_hash(), peers, deadline=time.monotonic() + 60)
    assert bytes(got.data) == bytes(frozen.data)
    assert stats.banned == [peers[0]]
    assert stats.by_provider[peers[0]] == 0


async def test_refused_for_another_spec_and_unknown_object(swarm):
    dhts, p2ps = swarm
    frozen = _state()
    await _serve(p2ps[1], frozen)
    peers = [dhts[1].peer_id.to_base58()]
    with pytest.raises(FetchFailed):
        await Fetcher(p2ps[0], "run", "b" * 64, chunk_timeout=5).fetch(
            frozen.manifest.manifest_hash(), peers, deadline=time.monotonic() + 20)
    with pytest.raises(FetchFailed):
        await Fetcher(p2ps[0], "run", SPEC, chunk_timeout=5).fetch("c" * 64, peers, deadline=time.monotonic() + 20)


async def test_provider_dies_mid_transfer_download_resumes_elsewhere(swarm):
    dhts, p2ps = swarm
    frozen = _state(nbytes=8 * 2**20, chunk_size=1 << 18)
    slow_calls = {"n": 0}

    class _DiesAfterFour(FrozenState):
        def chunk(self, index: int) -> memoryview:
            slow_calls["n"] += 1
            if slow_calls["n"] > 4:
                raise ConnectionError("provider died")
            return super().chunk(index)

    await _serve(p2ps[1], _DiesAfterFour(manifest=frozen.manifest, data=frozen.data))
    fetcher = Fetcher(p2ps[0], "run", SPEC, chunk_timeout=5)
    first = [dhts[1].peer_id.to_base58()]
    with pytest.raises(FetchFailed):  # the only provider dies: what verified is kept
        await fetcher.fetch(frozen.manifest.manifest_hash(), first, deadline=time.monotonic() + 20)
    kept = len(fetcher.partials[frozen.manifest.manifest_hash()].have)
    assert 1 <= kept < len(frozen.manifest.chunks)
    await _serve(p2ps[2], frozen)
    got, stats = await fetcher.fetch(frozen.manifest.manifest_hash(), [dhts[2].peer_id.to_base58()],
                                     deadline=time.monotonic() + 60)
    assert bytes(got.data) == bytes(frozen.data)
    assert stats.resumed_chunks == kept
    assert stats.bytes == frozen.manifest.total_bytes - sum(
        frozen.manifest.chunk_range(i)[1] - frozen.manifest.chunk_range(i)[0] for i in range(kept))


async def test_provider_killed_mid_transfer(swarm, monkeypatch):
    """A provider's whole peer (DHT and p2pd) dies in the middle: the others finish the transfer."""
    dhts, p2ps = swarm
    frozen = _state(nbytes=6 * 2**20, chunk_size=1 << 17)
    monkeypatch.setattr("swarmrun.node.faults.delay_seconds", lambda point: 0.02)  # every provider is slowish
    for p in p2ps[1:]:
        await _serve(p, frozen)
    fetcher = Fetcher(p2ps[0], "run", SPEC, chunk_timeout=3)
    peers = [d.peer_id.to_base58() for d in dhts[1:]]
    done = {"bytes": 0}

    def progress(new, total, active):
        done["bytes"] += new

    fetch = asyncio.create_task(fetcher.fetch(frozen.manifest.manifest_hash(), peers, deadline=time.monotonic() + 90,
                                              progress=progress))
    while done["bytes"] < frozen.manifest.total_bytes // 4:
        await asyncio.sleep(0.05)
    dhts[1].shutdown()  # kills its p2pd: its streams break mid-chunk
    got, stats = await fetch
    assert bytes(got.data) == bytes(frozen.data) and got.faults() == []
    assert stats.by_provider[peers[0]] < frozen.manifest.total_bytes // 2


async def test_manifest_not_matching_its_hash_bans_the_provider(swarm):
    dhts, p2ps = swarm
    frozen, other = _state(), _state(nbytes=2**20)

    class _Swapper(StateServer):
        def _find(self, manifest_hash):  # answers every request with another state's manifest
            return super()._find(other.manifest.manifest_hash())

    liar = _Swapper(p2ps[1], "run", admit_open(SPEC))
    await liar.start()
    liar.publish_state(other)
    await _serve(p2ps[2], frozen)
    peers = [dhts[1].peer_id.to_base58(), dhts[2].peer_id.to_base58()]
    fetcher = Fetcher(p2ps[0], "run", SPEC, chunk_timeout=10)
    got, stats = await fetcher.fetch(frozen.manifest.manifest_hash(), peers, deadline=time.monotonic() + 60)
    assert bytes(got.data) == bytes(frozen.data)
    assert stats.banned == [peers[0]] and fetcher.banned == {peers[0]}
    with pytest.raises(FetchFailed):  # a caught liar is never asked again
        await fetcher.fetch(other.manifest.manifest_hash(), peers[:1], deadline=time.monotonic() + 10)
