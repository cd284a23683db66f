"""A stranger declares a 2**40-byte JoinRequest to a real peer's averager and streams into it (issue 14): against
the code the audit tried, hivemind buffered whatever came (the averager grew 269 -> 572 MB on 300 MB and kept it),
before swarmrun's admission saw a byte. Here the averager of a `node join` peer closes the stream on the declared
length (net/bounds.py, installed in the averager's process): the peer's processes stay within a bound while the
stranger tries to push 256 MB, and the peer is alive afterwards. The attacker is a separate DHT node on loopback with
its own identity and no invite (tests/security/stranger.py), talking to the averager's registered handler.
"""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest
from hivemind.p2p import P2P, PeerID

from swarmrun.protocol.records import averager_prefix
from tests.security.stranger import Stranger
from tests.swarm_helpers import Swarm

pytestmark = pytest.mark.integration

RUN = "sec-averager"
MB = 1 << 20
PUSH = 256 * MB  # what the stranger tries to stream after its declared length
BOUND = 64 * MB  # how much the peer's processes may grow meanwhile (unbounded, they would hold the whole PUSH)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _rss(procs: list[psutil.Process], p2pd: bool) -> int:
    total = 0
    for p in procs:
        try:
            if (p.name() == "p2pd") == p2pd:
                total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


async def _declare_and_stream(stranger: Stranger, peer_id: str) -> tuple[int, str]:
    """Open the averager's rpc_join_group, declare 2**40 bytes, stream zeros; returns (bytes written, how it ended)."""
    p2p = await stranger.dht.replicate_p2p()
    name = f"{averager_prefix(RUN)}::RoundAverager.rpc_join_group"
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
    writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    chunk, sent = b"\x00" * MB, 0
    try:
        while sent < PUSH:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), timeout=10)
            sent += len(chunk)
        return sent, "all written"
    except asyncio.TimeoutError:
        return sent, "the peer stopped reading (backpressure)"
    except (ConnectionError, OSError) as e:
        return sent, f"closed: {type(e).__name__}"
    finally:
        writer.close()
        await p2p.shutdown()


@pytest.mark.timeout(240)
def test_a_declared_2_40_byte_join_request_does_not_grow_a_real_averager(tmp_path):
    with Swarm(tmp_path, RUN) as swarm:
        # --min-peers 2: the peer waits for a second trainer, its averager registered and idle (a steady baseline)
        swarm.create("p0", "--task", "synthetic", "--set", "total_steps=2000", "--min-peers", "2",
                     "--matchmaking-time", "1.0")
        peer_id = swarm.wait_for("p0", "listening", timeout=10)["peer_id"]
        procs = _tree(swarm.peers["p0"].proc.pid)
        time.sleep(3.0)
        base, base_p2pd = _rss(procs, p2pd=False), _rss(procs, p2pd=True)
        peak, stop = [base], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss(procs, p2pd=False))
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stranger = Stranger(swarm.maddr)
        try:
            t0 = time.monotonic()
            sent, ended = asyncio.run(_declare_and_stream(stranger, peer_id))
            took = time.monotonic() - t0
            time.sleep(2.0)
        finally:
            stop.set()
            sampler.join(timeout=5)
            stranger.shutdown()
        after, after_p2pd = _rss(procs, p2pd=False), _rss(procs, p2pd=True)
        report = (f"{len(procs)} processes: {base / MB:.0f} MB before, peak {peak[0] / MB:.0f} MB, {after / MB:.0f} MB "
                  f"after; p2pd {base_p2pd / MB:.0f} -> {after_p2pd / MB:.0f} MB; the stranger wrote {sent / MB:.0f} "
                  f"MB in {took:.1f}s ({ended})")
        print(report)
        assert peak[0] - base < BOUND, report
        assert after - base < BOUND, report
        assert sent < PUSH, report  # the stream was closed (or not read) long before the stranger's 256 MB went in
        assert swarm.peers["p0"].alive, swarm.log("p0")
        # the averager's handler was reached and refused the declared length (not a stream p2pd refused)
        log = (tmp_path / "p0.log").read_text(errors="replace")
        assert f"declared a JoinRequest of {1 << 40} bytes" in log, log[-3000:]
