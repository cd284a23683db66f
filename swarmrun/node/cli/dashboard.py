"""`node dashboard RUN_ID --peers MADDR [--http HOST:PORT]`: a run's page for a swarm without a coordinator.

One client-mode DHT node (like `node status`) reads the run's live progress reports and providers every
``--interval`` seconds into a ``SwarmWatch``; uvicorn serves the coordinator's run page from it on the same
asyncio loop. The page has no login (there are no users without a coordinator) and no actions; it shows
what any peer of the swarm can read, so it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from swarmrun.node.cli.common import EXIT_CODES, swarm_args

DEFAULT_HTTP = "127.0.0.1:8470"


def parse_http(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port). Raises UsageError."""
    from swarmrun.protocol.errors import UsageError

    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--http must be HOST:PORT, got {value!r}")
    return host, int(port)


async def read_swarm(dht, run_id: str, gate) -> dict:
    """One read of the run's live reports and providers, in the shape ``SwarmWatch.observe`` takes."""
    from swarmrun.node.net.records import read_providers, read_view
    from swarmrun.protocol.history import run_accounting
    from swarmrun.protocol.round import SUMMARY_KEYS

    await gate.refresh(dht)
    view = await read_view(dht, run_id, gate)
    accounting = run_accounting(view) or {}
    providers = sorted(({"peer_id": p, "step": r.step} for p, r in (await read_providers(dht, run_id)).items()),
                       key=lambda p: -p["step"])
    peers = [dict(peer_id=p, role=r.role.value, step=r.step) for p, r in view.reports.items() if not r.left]
    return dict(step=view.newest_step, finished=view.finished(), peers=peers, providers=providers,
                samples_per_second=sum(r.samples_per_second for r in view.trainers.values() if not r.left),
                **{k: accounting.get(k) for k in SUMMARY_KEYS})


async def _poll(dht, watch, gate, interval: float) -> None:
    while True:
        try:
            watch.observe(time.time(), await read_swarm(dht, watch.run_id, gate))
        except Exception as e:  # a failed read is shown on the page; the next one may work
            watch.failed(f"{type(e).__name__}: {e}")
        await asyncio.sleep(interval)


async def serve_dashboard(run_id: str, initial_peers, host: str, port: int, events, *, interval: float = 2.0,
                          timeout: float = 8.0) -> None:
    """Serve the run page until interrupted. Raises RunNotFound: no peer reachable, or the run unknown to them."""
    import uvicorn
    from hivemind import DHT
    from starlette.applications import Starlette

    from swarmrun.coordinator.swarm_page import SwarmWatch
    from swarmrun.coordinator.web import run_routes
    from swarmrun.node.net.records import fetch_spec
    from swarmrun.node.net.swarm import run_validators
    from swarmrun.node.peer.access import AccessGate
    from swarmrun.protocol.errors import RunNotFound

    try:
        dht = await asyncio.to_thread(DHT, initial_peers=list(initial_peers), start=True, client_mode=True,
                                      record_validators=run_validators(None, [run_id]), startup_timeout=timeout)
    except Exception as e:
        raise RunNotFound(f"could not reach any of the peers {', '.join(map(str, initial_peers))}: {e}") from None
    poll = None
    try:
        signed = await fetch_spec(dht, run_id, timeout=timeout)
        if signed is None:
            raise RunNotFound(f"run {run_id!r} was not found at the given peers")
        gate = AccessGate(signed.spec)  # an invite-only run's page shows only its certified peers' reports
        watch = SwarmWatch(run_id, task=signed.spec.task, total_steps=signed.spec.total_steps)
        server = uvicorn.Server(uvicorn.Config(Starlette(routes=run_routes(run_id, watch.render)), host=host, port=port,
                                               log_level="warning", lifespan="off"))
        poll = asyncio.create_task(_poll(dht, watch, gate, interval))
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()
            events.emit("dashboard", run_id=run_id, url=f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}/runs/{run_id}")
        await serving
    finally:
        if poll is not None:
            poll.cancel()
        await asyncio.to_thread(dht.shutdown)


def run_dashboard(args, events) -> int:
    from swarmrun.node.cli.common import require_peers, swarm_config
    from swarmrun.node.runtime import run_async
    from swarmrun.protocol.errors import UsageError
    from swarmrun.protocol.spec import check_run_id

    check_run_id(args.run_id)
    host, port = parse_http(args.http)
    if not args.interval > 0:
        raise UsageError("--interval must be positive")
    require_peers(args)
    config = swarm_config(args)
    run_async(serve_dashboard(args.run_id, config.initial_peers, host, port, events, interval=args.interval))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("dashboard", help="serve a run's page (progress, peers, data accounting) from its swarm",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("run_id", metavar="RUN_ID")
    swarm_args(s, listen=False)
    s.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT",
                   help=f"where to serve the page (default {DEFAULT_HTTP}; it has no login: bind beyond loopback "
                        "only where everyone who can reach it may see the run)")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between reads of the swarm (default 2)")
    s.add_argument("--json", action="store_true")
