"""The transfer's I/O parts in one process: a Fetcher and StateServers talking over socket pairs (the shape of a
hivemind P2P binary stream: a unix stream socket per stream) instead of p2pd, on asyncio's loop and on uvloop.

What the loopback tests (tests/integration/test_state_transfer.py) check with real p2pds, in milliseconds: the
joiner's in-place reading (``receive.Frames``), its verifier thread, lying, slow and dying providers, resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest
import torch
from blake3 import blake3
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from swarmrun.node.state.run import FrozenState, RunState
from swarmrun.node.net.fetch import KEEP_PARTIALS, Fetcher, FetchFailed
from swarmrun.node.net.serve import StateServer, admit_open
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.manifest import build_manifest
from swarmrun.protocol.transfer import Chunk

SPEC = "a" * 64
LOOPS = ["asyncio", "uvloop"]


def run(loop_kind: str, coro):
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


class Net:
    """Peers by name; a stream is a socket pair whose far end a registered handler serves on the same loop."""

    def __init__(self):
        self.handlers: dict[tuple[str, str], object] = {}
        self.tasks: list[asyncio.Task] = []

    def p2p(self, name: str) -> "FakeP2P":
        return FakeP2P(self, name)


class FakeP2P:
    def __init__(self, net: Net, name: str):
        self.net, self.peer_id = net, PeerID(name.encode())

    async def add_binary_stream_handler(self, proto: str, handler) -> None:
        self.net.handlers[(self.peer_id.to_base58(), proto)] = handler

    async def remove_binary_stream_handler(self, proto: str) -> None:
        self.net.handlers.pop((self.peer_id.to_base58(), proto), None)

    async def call_binary_stream_handler(self, peer: PeerID, proto: str):
        handler = self.net.handlers.get((peer.to_base58(), proto))
        if handler is None:
            raise ConnectionRefusedError(f"{peer} does not serve {proto}")
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        far_reader, far_writer = await asyncio.open_connection(sock=b)
        info = StreamInfo(self.peer_id, None, proto)
        self.net.tasks.append(asyncio.ensure_future(handler(info, far_reader, far_writer)))
        return info, reader, writer


def pid(name: str) -> str:
    return PeerID(name.encode()).to_base58()


def make_state(nbytes: int = 3 * 2**20 + 123, chunk_size: int = 1 << 18, seed: int = 0) -> FrozenState:
    g = torch.Generator().manual_seed(seed)
    view = memoryview(bytearray(torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()))
    half = nbytes // 3
    manifest = build_manifest(spec_hash=SPEC, step=7, chunk_size=chunk_size, content={},
                              tensors=[("model/a", "uint8", (half,), view[:half]),
                                       ("model/b", "uint8", (nbytes - half,), view[half:])])
    return FrozenState(manifest=manifest, data=view.toreadonly())


class Corrupt(FrozenState):
    """Serves wrong bytes for every chunk (with the honest manifest)."""

    def chunk(self, index: int) -> memoryview:
        data = bytearray(super().chunk(index))
        data[0] ^= 0xFF
        return memoryview(bytes(data))


async def serve(net: Net, name: str, frozen: FrozenState, cls=StateServer) -> StateServer:
    server = cls(net.p2p(name), "run", admit_open(SPEC))
    await server.start()
    server.publish_state(frozen)
    return server


async def fetch(net: Net, frozen: FrozenState, names, fetcher=None, **kwargs):
    fetcher = fetcher or Fetcher(net.p2p("joiner"), "run", SPEC, chunk_timeout=kwargs.pop("chunk_timeout", 5))
    got, stats = await fetcher.fetch(frozen.manifest.manifest_hash(), [pid(n) for n in names],
                                     deadline=time.monotonic() + kwargs.pop("timeout", 30), **kwargs)
    return fetcher, got, stats


@pytest.mark.parametrize("loop", LOOPS)
def test_three_providers_share_the_queue_and_every_byte_verifies(loop):
    async def main():
        net, frozen = Net(), make_state()
        servers = [await serve(net, f"p{i}", frozen) for i in range(3)]
        seen = []
        _, got, stats = await fetch(net, frozen, ["p0", "p1", "p2"], progress=lambda *a: seen.append(a))
        assert bytes(got.data) == bytes(frozen.data) and got.faults() == []
        assert got.manifest == frozen.manifest
        assert stats.bytes == frozen.manifest.total_bytes == sum(a[0] for a in seen)
        assert sum(1 for b in stats.by_provider.values() if b > 0) >= 2
        assert sum(s.bytes_served for s in servers) >= frozen.manifest.total_bytes
    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_corrupt_provider_is_banned_and_its_chunks_come_from_another(loop):
    async def main():
        net, frozen = Net(), make_state()
        await serve(net, "liar", Corrupt(manifest=frozen.manifest, data=frozen.data))
        await serve(net, "honest", frozen)
        fetcher, got, stats = await fetch(net, frozen, ["liar", "honest"])
        assert bytes(got.data) == bytes(frozen.data)
        assert stats.banned == [pid("liar")] and fetcher.banned == {pid("liar")}
        assert stats.by_provider[pid("liar")] == 0
    run(loop, main())


def test_a_provider_answering_out_of_turn_or_with_a_wrong_size_is_banned():
    class OutOfTurn(StateServer):
        async def _handle(self, info, reader, writer):  # answers every get with chunk 0 (or a wrong size)
            from swarmrun.node.net.streams import read_header, write_message
            from swarmrun.protocol.transfer import Opened
            try:
                await read_header(reader)
                await write_message(writer, Opened(size=len(self.current.encoded)).encode(), self.current.encoded)
                while True:
                    get = await read_header(reader)
                    size = 5 if self.wrong_size else self.current.frozen.chunk(0).nbytes
                    await write_message(writer, Chunk(index=0 if not self.wrong_size else get.index, size=size).encode(),
                                        bytes(self.current.frozen.chunk(0)[:size]))
            except (ConnectionError, asyncio.IncompleteReadError):  # banned: the fetcher closed the stream
                return

    async def main():
        net, frozen = Net(), make_state()
        for name, wrong_size in (("turn", False), ("size", True)):
            liar = await serve(net, name, frozen, cls=OutOfTurn)
            liar.wrong_size = wrong_size
        await serve(net, "honest", frozen)
        _, got, stats = await fetch(net, frozen, ["turn", "size", "honest"])
        assert bytes(got.data) == bytes(frozen.data)
        assert stats.banned == sorted([pid("turn"), pid("size")])
    asyncio.run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_dying_provider_keeps_what_verified_and_the_next_fetch_resumes(loop):
    async def main():
        net, frozen = Net(), make_state(nbytes=8 * 2**20)
        calls = {"n": 0}

        class DiesAfterFour(FrozenState):
            def chunk(self, index: int) -> memoryview:
                calls["n"] += 1
                if calls["n"] > 4:
                    raise ConnectionError("provider died")
                return super().chunk(index)

        await serve(net, "dies", DiesAfterFour(manifest=frozen.manifest, data=frozen.data))
        fetcher = Fetcher(net.p2p("joiner"), "run", SPEC, chunk_timeout=2)
        with pytest.raises(FetchFailed):
            await fetch(net, frozen, ["dies"], fetcher=fetcher, timeout=10)
        kept = len(fetcher.partials[frozen.manifest.manifest_hash()].have)
        assert 1 <= kept < len(frozen.manifest.chunks)
        await serve(net, "ok", frozen)
        _, got, stats = await fetch(net, frozen, ["ok"], fetcher=fetcher)
        assert bytes(got.data) == bytes(frozen.data) and got.faults() == []
        assert stats.resumed_chunks == kept
        assert stats.bytes == frozen.manifest.total_bytes - sum(
            frozen.manifest.chunk_range(i)[1] - frozen.manifest.chunk_range(i)[0] for i in range(kept))
    run(loop, main())



def test_only_the_newest_partial_downloads_are_kept():
    async def main():
        net = Net()
        fetcher = Fetcher(net.p2p("joiner"), "run", SPEC, chunk_timeout=2)
        states = [make_state(nbytes=2**20, chunk_size=1 << 16, seed=s) for s in range(KEEP_PARTIALS + 1)]
        for i, frozen in enumerate(states):
            served = {"n": 0}

            class DiesAfterTwo(FrozenState):
                def chunk(self, index: int, served=served) -> memoryview:
                    served["n"] += 1
                    if served["n"] > 2:
                        raise ConnectionError("provider died")
                    return super().chunk(index)

            await serve(net, f"dies{i}", DiesAfterTwo(manifest=frozen.manifest, data=frozen.data))
            with pytest.raises(FetchFailed):
                await fetch(net, frozen, [f"dies{i}"], fetcher=fetcher, timeout=5)
        hashes = [s.manifest.manifest_hash() for s in states]
        assert list(fetcher.partials) == hashes[1:]  # the oldest went, buffer and all
        # one resumes from what it kept; once finished it is no longer kept
        await serve(net, "ok", states[1])
        _, got, stats = await fetch(net, states[1], ["ok"], fetcher=fetcher)
        assert stats.resumed_chunks >= 1 and bytes(got.data) == bytes(states[1].data)
        assert list(fetcher.partials) == hashes[2:]
    asyncio.run(main())


class _SlowWriter:
    def __init__(self, writer, delay: float):
        self.writer, self.delay = writer, delay

    def write(self, data) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await asyncio.sleep(self.delay)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


class SlowServer(StateServer):
    async def _handle(self, info, reader, writer):
        # 0.2 s per write: slower than the fast provider by far even on a loaded 2-core machine (at 0.02 s the order
        # of the two once flipped under a load of 4.5)
        await super()._handle(info, reader, _SlowWriter(writer, 0.2))


@pytest.mark.parametrize("loop", LOOPS)
def test_end_game_duplicates_of_a_slow_provider_land_once(loop):
    async def main():
        net, frozen = Net(), make_state(nbytes=2**20, chunk_size=1 << 16)
        slow = await serve(net, "slow", frozen, cls=SlowServer)
        fast = await serve(net, "fast", frozen)
        _, got, stats = await fetch(net, frozen, ["slow", "fast"])
        assert bytes(got.data) == bytes(frozen.data) and got.faults() == []
        assert stats.bytes == frozen.manifest.total_bytes  # each chunk counted once
        assert stats.by_provider[pid("fast")] > stats.by_provider[pid("slow")]
        # the slow one was asked first (chunks 0..3): the fast one sent them too, the end game did not wait
        assert slow.bytes_served < frozen.manifest.total_bytes
        assert fast.bytes_served + slow.bytes_served >= frozen.manifest.total_bytes
    run(loop, main())


class _HeldVerifier:
    """Verdicts on demand, so a test orders them."""

    def __init__(self, manifest):
        self.manifest, self.jobs = manifest, {}

    def submit(self, index, view, verdict):
        self.jobs.setdefault(index, []).append((view, verdict))

    def release(self, index: int) -> None:
        view, verdict = self.jobs[index].pop(0)
        verdict(self.manifest.verify_chunk(index, view))


def test_download_keeps_a_verified_second_copy_until_the_first_lets_go():
    from swarmrun.node.net.receive import Download
    from swarmrun.node.state.run import alloc_buffer
    from swarmrun.node.net.fetch import Partial
    from swarmrun.protocol.transfer import TransferPlan

    async def main():
        frozen = make_state(nbytes=4 * 1024, chunk_size=1024)
        m = frozen.manifest
        partial = Partial(m, alloc_buffer(m.total_bytes))
        plan = TransferPlan(len(m.chunks))
        for p in ("a", "b", "c"):
            plan.add_provider(p)
        verifier = _HeldVerifier(m)
        finished = asyncio.get_running_loop().create_future()
        dl = Download(partial, plan, verifier, None, set(), finished)

        def arrive(provider, index, corrupt=False):
            """A chunk's header and bytes arrive on ``provider``'s stream; returns (view, whether it is the buffer)."""
            view, own = dl.target(provider, index)
            view[:] = frozen.chunk(index)
            if corrupt:
                view[0] ^= 1
            return view, own

        assert [plan.next_chunk("a") for _ in range(4)] == [0, 1, 2, 3]
        assert plan.next_chunk("b") == 0  # the end game: a duplicate of a's chunk 0
        # chunk 0: a's copy goes into the buffer, b's into a spare; b's verifies first, then a's turns out bad
        a_view, a_own = arrive("a", 0, corrupt=True)
        b_view, b_own = arrive("b", 0)
        assert a_own and not b_own
        dl.received("b", 0, b_view, b_own)
        verifier.release(0)
        assert 0 in plan.done and 0 in dl.spares and 0 not in partial.have  # a still writes/checks that range
        dl.received("a", 0, a_view, a_own)
        verifier.release(0)
        assert plan.providers["a"].banned and "a" in dl.lied
        assert 0 in partial.have and not dl.spares  # a let go: the spare went in
        # chunk 1 (re-queued from the liar): c's copy is arriving in the buffer when b's duplicate verifies;
        # then c's stream ends inside chunk 1
        assert plan.next_chunk("c") == 1
        c_view, c_own = dl.target("c", 1)
        assert c_own
        assert [plan.next_chunk("b") for _ in range(3)] == [2, 3, None]  # a duplicate only once b is idle
        for i in (2, 3):
            dl.received("b", i, *arrive("b", i))
            verifier.release(i)
        assert plan.next_chunk("b") == 1
        b_view, b_own = arrive("b", 1)
        dl.received("b", 1, b_view, b_own)
        verifier.release(1)
        assert 1 in dl.spares and 1 not in partial.have
        dl.interrupted(1, c_own)
        assert 1 in partial.have and not dl.spares
        # a late duplicate of a done chunk is not even checked
        late_view, late_own = dl.target("c", 1)
        assert not late_own
        dl.received("c", 1, late_view, late_own)
        assert not verifier.jobs[1]
        assert plan.finished and finished.done() and dl.pending == 0
        assert bytes(partial.data) == bytes(frozen.data) and partial.have == {0, 1, 2, 3}
    asyncio.run(main())


def test_a_manifest_whose_tensor_digests_lie_fails_after_the_chunks_verify():
    async def main():
        net, honest = Net(), make_state()
        entries = list(honest.manifest.tensors)
        entries[1] = dataclasses.replace(entries[1], digest=blake3(b"other bytes").hexdigest())
        frozen = FrozenState(manifest=dataclasses.replace(honest.manifest, tensors=tuple(entries)), data=honest.data)
        await serve(net, "p0", frozen)
        with pytest.raises(FetchFailed, match="tensor model/b does not match its hash"):
            await fetch(net, frozen, ["p0"])
    asyncio.run(main())


def test_unknown_object_and_another_runs_spec_are_refused():
    async def main():
        net, frozen = Net(), make_state()
        await serve(net, "p0", frozen)
        with pytest.raises(FetchFailed):
            await Fetcher(net.p2p("j"), "run", "b" * 64, chunk_timeout=2).fetch(
                frozen.manifest.manifest_hash(), [pid("p0")], deadline=time.monotonic() + 10)
        with pytest.raises(FetchFailed):
            await Fetcher(net.p2p("j"), "run", SPEC, chunk_timeout=2).fetch(
                "c" * 64, [pid("p0")], deadline=time.monotonic() + 10)
    asyncio.run(main())


def _run_state(seed: int, stepped: bool) -> RunState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if stepped:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    return RunState(model=model, optimizer=optimizer, scheduler=scheduler, step=int(stepped),
                    cursor=DataCursor.new(seed=1, num_examples=64, block_size=8), spec_hash=SPEC, seed=1)


def test_a_fetched_state_is_adopted_without_copies_and_trains_on():
    async def main():
        net, provider = Net(), _run_state(0, stepped=True)
        frozen = provider.freeze(chunk_size=4096)
        await serve(net, "p0", frozen)
        joiner = _run_state(1, stepped=False)
        _, got, _ = await fetch(net, frozen, ["p0"])
        buffer = got.data.obj
        joiner.apply_frozen(got, adopt=True)
        assert joiner.state_hash() == provider.state_hash() == frozen.manifest.state_hash()
        base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        moments = [t for s in joiner.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        params = list(joiner.model.parameters())
        assert all(base <= t.data_ptr() < base + len(buffer) for t in moments + params)  # views of the received buffer
        assert params == joiner.optimizer.param_groups[0]["params"]  # the same Parameter objects, new data
        for state in (provider, joiner):  # the adopted state trains on like the provider's own
            for p in state.model.parameters():
                p.grad = torch.ones_like(p)
            state.optimizer.step()
        assert joiner.state_hash() == provider.state_hash()
        assert frozen.faults() == []  # the provider's frozen copy was not touched
    asyncio.run(main())


def test_release_pages_hands_back_whole_pages_outside_what_is_kept():
    from swarmrun.node.state.run import alloc_buffer, release_pages

    buf = alloc_buffer(10 * 4096)
    buf[:] = b"\x07" * len(buf)
    assert release_pages(buf.obj, [(100, 5000), (4096 * 6 + 1, 4096 * 7)]) == 4096 * 7  # pages 2-5 and 7-9
    assert bytes(buf[:8192]) == b"\x07" * 8192 and bytes(buf[8192:6 * 4096]) == bytes(4 * 4096)
    assert bytes(buf[6 * 4096:7 * 4096]) == b"\x07" * 4096 and bytes(buf[7 * 4096:]) == bytes(3 * 4096)
    assert release_pages(bytearray(10), []) == 0


def test_apply_without_adopt_copies_the_optimizer_state():
    provider = _run_state(0, stepped=True)
    frozen = provider.freeze(chunk_size=4096)
    joiner = _run_state(1, stepped=False)
    joiner.apply_frozen(frozen)
    for p in joiner.model.parameters():
        p.grad = torch.ones_like(p)
    joiner.optimizer.step()
    assert frozen.faults() == [] and joiner.state_hash() != frozen.manifest.state_hash()


def test_an_announced_state_stays_served_however_fast_the_swarm_steps():
    """A swarm at ~70 steps/s replaces its state many times between a joiner reading a provider record and asking
    for it: what the record named stays, until ``max_announced`` newer announcements (issue 14)."""
    from swarmrun.node.net.serve import StateServer

    server = StateServer(None, "r", lambda request, remote: None, max_old_states=2, linger=0.0, max_announced=2)
    states = [make_state(nbytes=4096, chunk_size=1024, seed=i) for i in range(12)]
    hashes = [s.manifest.manifest_hash() for s in states]
    server.publish_state(states[0])
    server.announce(hashes[0])
    for s in states[1:10]:  # nine more steps before the joiner asks
        server.publish_state(s)
    assert server._find(hashes[0]) is not None, "the announced state was dropped"
    assert server._find(hashes[1]) is None  # an unannounced old one goes as before (max_old_states, linger)
    server.announce("f" * 64)  # not the current state: nothing pinned
    server.announce(hashes[9])
    server.publish_state(states[10])
    server.announce(hashes[10])
    assert server._find(hashes[0]) is None and server._find(hashes[9]) is not None  # two announced at most
    # one in use by a transfer stays past the bound
    server._announced[hashes[9]].sessions = 1
    server.publish_state(states[11])
    server.announce(hashes[11])
    assert server._find(hashes[9]) is not None


class _GoneWriter(_SlowWriter):
    """A joiner that went before the provider's answer left (its fetch had the state from another provider)."""

    def write(self, data) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


class GoneJoinerServer(StateServer):
    gone = True

    async def _handle(self, info, reader, writer):
        await super()._handle(info, reader, _GoneWriter(writer, 0.0) if self.gone else writer)


def test_a_joiner_gone_before_the_manifest_left_does_not_hold_a_session():
    """A session whose ``opened`` answer could not be sent is not counted: eight such joiners (a keeper catching
    up over and over, cancelling its other providers' streams each time) once left a provider "busy" forever."""
    async def main():
        net, frozen = Net(), make_state()
        server = await serve(net, "p0", frozen, cls=GoneJoinerServer)
        for _ in range(server.max_sessions + 2):
            with pytest.raises(FetchFailed, match="ConnectionResetError|IncompleteReadError|ConnectionError"):
                await fetch(net, frozen, ["p0"], chunk_timeout=2, timeout=10)
            await asyncio.gather(*net.tasks, return_exceptions=True)
        assert server.sessions == 0
        server.gone = False
        _, got, _ = await fetch(net, frozen, ["p0"])
        assert bytes(got.data) == bytes(frozen.data)
    asyncio.run(main())


class _DeafWriter(_SlowWriter):
    """A joiner that keeps its stream open and never reads: the provider's writes never drain."""

    async def drain(self) -> None:
        await asyncio.Event().wait()


class DeafJoinerServer(StateServer):
    async def _handle(self, info, reader, writer):
        await super()._handle(info, reader, _DeafWriter(writer, 0.0))


def test_a_joiner_that_stops_reading_gives_its_session_back_after_the_chunk_timeout():
    async def main():
        net, frozen = Net(), make_state()
        server = DeafJoinerServer(net.p2p("p0"), "run", admit_open(SPEC), chunk_timeout=0.5)
        await server.start()
        server.publish_state(frozen)
        with pytest.raises(FetchFailed):
            await fetch(net, frozen, ["p0"], chunk_timeout=2, timeout=4)
        await asyncio.wait_for(asyncio.gather(*net.tasks, return_exceptions=True), 10)
        assert server.sessions == 0
    asyncio.run(main())
