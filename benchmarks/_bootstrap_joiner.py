"""One joiner of the bootstrap benchmark: a fresh process (its own DHT and p2pd) that takes the state once and exits.

Modes, each timed from the request until the state is loaded in this process's model and optimizer:
- ``swarmrun``: the join path of ``Trainer``: read the run's provider records from the DHT, ``choose_state``,
  ``Fetcher.fetch`` from the ``k`` providers (it verifies every chunk and tensor digest as the chunks arrive), check
  the state hash, ``RunState.apply_frozen(adopt=True)``;
- ``hivemind``: ``DecentralizedAverager.load_state_from_peers`` (one donor), then the same ``RunState.apply``;
- ``raw``: the path's ceiling: one raw binary stream per provider, each sending its share of the state's bytes in
  1 MiB writes; nothing is loaded (the bytes are read and dropped).

The DHT is connected to every provider before the clock starts, for every mode alike. Prints one JSON line
``result`` (seconds, bytes, MB/s, whether the loaded state's hash equals the providers', a breakdown), or ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import struct
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from hivemind import DHT  # noqa: E402
from hivemind.p2p import PeerID  # noqa: E402

from _bootstrap_state import (LOOPS, MB, RAW_PROTOCOL, BenchAverager, apply_hivemind, build_state,  # noqa: E402
                              hivemind_prefix, make_dht, run_id_for, run_loop)
from _common import emit  # noqa: E402
from swarmrun.node import read_providers  # noqa: E402
from swarmrun.node import Fetcher  # noqa: E402
from swarmrun.protocol.transfer import choose_state  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("swarmrun", "hivemind", "raw"), required=True)
    p.add_argument("--k", type=int, default=1, help="providers to take the state from (swarmrun, raw)")
    p.add_argument("--run-base", required=True)
    p.add_argument("--providers", nargs="+", required=True, help="provider peer ids, by index (raw)")
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--state-dir", required=True, help="where this peer's identity file goes")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--state-hash", required=True, help="the providers' state hash (to check the loaded state)")
    p.add_argument("--total-bytes", type=int, required=True)
    p.add_argument("--window", type=int, default=None, help="Fetcher window (default: swarmrun's)")
    p.add_argument("--chunk-timeout", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--wait-go", action="store_true", help="after ready, wait for a line 'go' on stdin")
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop of the swarmrun and raw modes")
    return p.parse_args(argv)


def wait_go(opts) -> None:
    """Set up, say ``ready``, and start only on ``go`` (stdin): the driver starts a repeat's joiners together and
    then runs them one at a time, so process start-up is not paid once per run."""
    emit("ready", mode=opts.mode, k=opts.k)
    if opts.wait_go and sys.stdin.readline().strip() != "go":
        raise RuntimeError("stdin closed before go")


async def ready_then_go(opts) -> None:
    await asyncio.get_running_loop().run_in_executor(None, wait_go, opts)


async def take_swarmrun(opts, dht: DHT, state) -> dict:
    p2p = await dht.replicate_p2p()
    kwargs = {} if opts.window is None else dict(window=opts.window)
    run_id = run_id_for(opts.run_base, opts.k)
    fetcher = Fetcher(p2p, run_id, state.spec_hash, chunk_timeout=opts.chunk_timeout, **kwargs)
    await ready_then_go(opts)
    t0, cpu0 = time.monotonic(), _cpu()
    deadline = t0 + opts.timeout
    records = await read_providers(dht, run_id)
    choice = choose_state(records)
    if choice is None or len(choice.providers) != opts.k:
        raise RuntimeError(f"DHT lookup found {0 if choice is None else len(choice.providers)} providers of run "
                           f"{run_id}, expected {opts.k}")
    t_lookup = time.monotonic()
    frozen, stats = await fetcher.fetch(choice.manifest_hash, choice.providers, deadline=deadline)
    t_fetch = time.monotonic()
    # as Trainer._fetch_state: the fetch verified every chunk and tensor digest; the state hash is checked here
    if frozen.manifest.state_hash() != choice.state_hash:
        raise RuntimeError("fetched state does not verify: state_hash")
    t_verify = time.monotonic()
    chunks = len(frozen.manifest.chunks)
    await asyncio.to_thread(state.apply_frozen, frozen, adopt=True)  # as Trainer.catch_up
    t1 = time.monotonic()
    return dict(seconds=t1 - t0, lookup_s=t_lookup - t0, fetch_s=t_fetch - t_lookup, verify_s=t_verify - t_fetch,
                apply_s=t1 - t_verify, cpu_s=_cpu() - cpu0,
                fetch_mb_per_s=stats.bytes / MB / max(stats.seconds, 1e-9),
                by_provider={p[-8:]: b for p, b in stats.by_provider.items()}, banned=len(stats.banned),
                window=fetcher.window, chunks=chunks)


def take_hivemind(opts, averager, state) -> dict:
    wait_go(opts)
    t0 = time.monotonic()
    loaded = averager.load_state_from_peers(timeout=opts.timeout)
    t_fetch = time.monotonic()
    if loaded is None:
        raise RuntimeError("hivemind's load_state_from_peers found no donor or got nothing")
    metadata, tensors = loaded
    apply_hivemind(state, metadata, list(tensors))
    t1 = time.monotonic()
    return dict(seconds=t1 - t0, fetch_s=t_fetch - t0, apply_s=t1 - t_fetch)


async def take_raw(opts, dht: DHT) -> dict:
    p2p = await dht.replicate_p2p()
    peers = [PeerID.from_base58(p) for p in opts.providers[:opts.k]]
    share = -(-opts.total_bytes // len(peers))
    await ready_then_go(opts)
    t0, cpu0 = time.monotonic(), _cpu()

    async def one(i: int, peer: PeerID) -> int:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, RAW_PROTOCOL)
        try:
            length = max(0, min(share, opts.total_bytes - i * share))
            writer.write(struct.pack(">QQ", i * share, length))
            await writer.drain()
            got = 0
            while got < length:
                data = await reader.read(1 << 20)
                if not data:
                    raise RuntimeError(f"raw stream from provider {i} ended after {got}/{length} bytes")
                got += len(data)
            return got
        finally:
            writer.close()

    got = await asyncio.wait_for(asyncio.gather(*[one(i, p) for i, p in enumerate(peers)]), opts.timeout)
    return dict(seconds=time.monotonic() - t0, cpu_s=_cpu() - cpu0, bytes_received=sum(got))


def _cpu() -> float:
    """CPU seconds of this process so far (every thread, user and system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    opts = parse_args(argv)
    dht = averager = None
    try:
        state = None
        if opts.mode != "raw":  # a fresh model from another seed: loading must replace every bit of it
            state = build_state(hidden=opts.hidden, layers=opts.layers, seed=opts.seed, run_base=opts.run_base,
                                stepped=False)
        dht, _ = make_dht(opts.host, opts.initial_peers, Path(opts.state_dir), [run_id_for(opts.run_base, opts.k)])
        if opts.mode == "swarmrun":
            out = run_loop(opts.loop, take_swarmrun(opts, dht, state))
        elif opts.mode == "hivemind":
            averager = BenchAverager([torch.zeros(1)], dht, start=True, prefix=hivemind_prefix(opts.run_base),
                                     allow_state_sharing=False)
            out = take_hivemind(opts, averager, state)
        else:
            out = run_loop(opts.loop, take_raw(opts, dht))
        out.update(mode=opts.mode, k=1 if opts.mode == "hivemind" else opts.k, bytes=opts.total_bytes,
                   mb_per_s=opts.total_bytes / MB / out["seconds"])
        if state is not None:
            got = state.state_hash()
            out.update(verified=got == opts.state_hash, state_hash=got, step=state.step)
        else:
            out.update(verified=out["bytes_received"] == opts.total_bytes)
        emit("result", **out)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        emit("error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
        return 1
    finally:  # after the result is out: the driver kills this process group once it has it
        if averager is not None:
            averager.shutdown()
        if dht is not None:
            dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
