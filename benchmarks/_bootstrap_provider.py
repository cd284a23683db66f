"""One provider of the bootstrap benchmark (a separate process: its own hivemind DHT and p2pd).

It builds the benchmark state, freezes it, and serves it three ways at once until stdin closes:
- swarmrun: a ``StateServer`` for each provider count ``k`` it takes part in (run ``<base>-k<k>`` for every
  ``k > index``), announced in the DHT with a ``ProviderRecord`` as a trainer does (re-announced every few seconds);
- the raw ceiling: a binary stream handler that writes any requested byte range of the frozen state in 1 MiB writes;
- hivemind (``--hivemind``, once the driver writes ``donate``): a ``DecentralizedAverager`` with
  ``allow_state_sharing=True`` whose ``get_current_state`` returns the live model and optimizer tensors
  (hivemind's own donor path).

Prints JSON lines ``ready`` (peer id, maddrs, manifest and state hash, bytes) and ``donating``; errors as ``error``.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from hivemind import DHT  # noqa: E402
from hivemind.utils.timed_storage import get_dht_time  # noqa: E402

from _bootstrap_state import (LOOPS, RAW_PROTOCOL, RAW_WRITE, BenchAverager, build_state,  # noqa: E402
                              hivemind_prefix, live_tensors, make_dht, run_id_for, run_loop)
from _common import emit  # noqa: E402
from swarmrun.node import record_validator, signed_subkey  # noqa: E402
from swarmrun.node import StateServer, admit_open  # noqa: E402
from swarmrun.protocol.transfer import ProviderRecord, providers_key  # noqa: E402

PROVIDER_COUNTS = (1, 2, 4)
ANNOUNCE_EVERY = 3.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-base", required=True)
    p.add_argument("--index", type=int, required=True, help="provider index (serves runs with k > index)")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=1 << 20)
    p.add_argument("--state-dir", required=True, help="where this peer's identity file goes")
    p.add_argument("--hivemind", action="store_true", help="also be hivemind's state donor")
    p.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="event loop of the swarmrun and raw servers")
    return p.parse_args(argv)


async def serve(opts, dht: DHT, key, frozen, spec_hash: str, donate=None) -> None:
    """Serve until stdin closes; on the line ``donate``, call ``donate`` (start hivemind's donor) and say so."""
    p2p = await dht.replicate_p2p()
    peer_id = dht.peer_id.to_base58()
    subkey = signed_subkey(record_validator(key), peer_id)  # as Trainer: the record is signed by this peer
    data = frozen.data
    runs = [run_id_for(opts.run_base, k) for k in PROVIDER_COUNTS if k > opts.index]
    for run_id in runs:
        server = StateServer(p2p, run_id, admit_open(spec_hash))
        await server.start()
        server.publish_state(frozen)

    async def raw(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            offset, length = struct.unpack(">QQ", await reader.readexactly(16))
            end = min(offset + length, data.nbytes)
            while offset < end:
                writer.write(data[offset:min(offset + RAW_WRITE, end)])
                await writer.drain()
                offset += RAW_WRITE
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(RAW_PROTOCOL, raw)
    record = ProviderRecord(step=frozen.step, manifest_hash=frozen.manifest.manifest_hash(),
                            state_hash=frozen.manifest.state_hash(), total_bytes=frozen.manifest.total_bytes,
                            time=get_dht_time())

    async def announce() -> None:
        futures = [dht.store(providers_key(run_id), subkey=subkey, value=record.encode(),
                             expiration_time=get_dht_time() + 60, return_future=True) for run_id in runs]
        await asyncio.gather(*[asyncio.wait_for(_wait(f), 30) for f in futures], return_exceptions=True)

    await announce()
    emit("ready", index=opts.index, peer_id=peer_id, maddrs=[str(m) for m in dht.get_visible_maddrs()],
         manifest_hash=record.manifest_hash, state_hash=record.state_hash, total_bytes=record.total_bytes,
         chunks=len(frozen.manifest.chunks), runs=runs)
    loop = asyncio.get_running_loop()
    line = loop.run_in_executor(None, sys.stdin.readline)
    while True:
        await asyncio.wait([line], timeout=ANNOUNCE_EVERY)
        if line.done():
            command = line.result().strip()
            if not command:
                return  # stdin closed: the driver is done with this provider
            if command == "donate" and donate is not None:
                donate()  # in the main thread (it forks hivemind's averager process); nothing is being served yet
                emit("donating")
            line = loop.run_in_executor(None, sys.stdin.readline)
        await announce()


async def _wait(mpfuture):
    return await mpfuture


def main(argv=None) -> int:
    opts = parse_args(argv)
    dht = None
    try:
        state = build_state(hidden=opts.hidden, layers=opts.layers, seed=opts.seed, run_base=opts.run_base,
                            stepped=True)
        frozen = state.freeze(chunk_size=opts.chunk_size)
        dht, key = make_dht(opts.host, opts.initial_peers, Path(opts.state_dir),
                            [run_id_for(opts.run_base, k) for k in PROVIDER_COUNTS if k > opts.index])
        donors = []

        def donate() -> None:
            # started once every provider is in the DHT (the driver says when): hivemind declares a donor when it
            # starts and then every declare_state_period, so a declaration made by a lone first peer could stay
            # where a joiner's lookup does not look
            names, tensors = live_tensors(state)
            metadata = dict(spec_hash=state.spec_hash, step=state.step, content=frozen.manifest.content)
            donors.append(BenchAverager([torch.zeros(1)], dht, names=names, tensors=tensors, metadata=metadata,
                                        start=True, prefix=hivemind_prefix(opts.run_base), allow_state_sharing=True,
                                        declare_state_period=10))

        try:
            run_loop(opts.loop, serve(opts, dht, key, frozen, state.spec_hash, donate if opts.hivemind else None))
        finally:
            for donor in donors:
                donor.shutdown()
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        emit("error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
        return 1
    finally:
        if dht is not None:
            dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
