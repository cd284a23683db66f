"""`node coordinator`: the pool service. One process, one asyncio loop: uvicorn serving the HTTP API, and the
placement loop that reads the registry, asks ``plan`` what to do and records its actions.

The glue is two functions tested on their own: ``placement_view`` converts the registry's plain rows into
placement's dataclasses, ``carry_out`` records ``plan``'s actions in the registry (compare-and-set on run states,
so a user's hold or cancel that lands between the read and the write wins). Everything the coordinator knows is in
the registry's database, so a coordinator killed with SIGKILL and restarted on the same database goes on where it
was; the agents keep their peers training meanwhile (a heartbeat that fails changes nothing on a workstation).

Isolation (``owner.py``): every pool run is invite-only and the coordinator holds its owner key (sealed in the
database under a secret in its state dir); it certifies the
peer an assigned worker starts and revokes that certificate after the worker's release. Its own DHT peer
(``peer.PoolPeer``, started and shut down with the service) is the bootstrap point of every pool run and publishes
the runs' revocation lists.

Keepers (``keepers.py``): a ``node keep`` child per running run, bootstrapped through that peer, holds the run's
newest state, so a run whose trainers all vanish at once still has a provider of it, not only the store's last
snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from swarmrun.coordinator.owner import REVOKE_AFTER
from swarmrun.coordinator.placement import (
    Assign, Assignment, Needs, Pause, Policy, PoolRun, Release, Resume, RunState, Worker, plan,
)
from swarmrun.coordinator.registry import PoolRows, Registry
from swarmrun.protocol.errors import Conflict, RunNotFound, SwarmrunError, UsageError

__all__ = ["CoordinatorConfig", "placement_view", "carry_out", "finished_runs", "serve", "parse_http"]

logger = logging.getLogger("swarmrun.coordinator")
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """One coordinator: where it listens (HTTP, and its peer's ``listen``/``announce`` multiaddrs), its state dir
    (its peer's identity), database and store, how often it places, how long after a release it revokes."""

    host: str = "127.0.0.1"
    port: int = 8470
    db_url: str
    store: str
    state_dir: Path
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()
    placement_interval: float = 1.0
    revoke_after: float = REVOKE_AFTER
    policy: Policy = Policy()
    keepers: bool = True  # a `node keep` child per running run (keepers.py)


def parse_http(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port). Raises UsageError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or not host:
        raise UsageError(f"--http expects HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _devices(resources: dict[str, Any]) -> dict[str, int]:
    """A worker's resources as placement's {device kind: bytes}: RAM as "cpu", the smallest GPU per kind."""
    out = {"cpu": int(float(resources.get("ram_gib") or 0.0) * _GIB)}
    for device in resources.get("devices") or ():
        memory = int(float(device.get("memory_gib") or 0.0) * _GIB)
        kind = device["kind"]
        out[kind] = min(out.get(kind, memory), memory)
    return out


def placement_view(rows: PoolRows, *, up_since: float = 0.0) -> tuple[list[PoolRun], list[Worker], list[Assignment]]:
    """The registry's rows as the dataclasses ``plan`` reads (runs oldest first, workers, assignments).

    ``up_since``: when this coordinator began serving. A worker is not heard from while the coordinator is down, so
    its ``last_seen`` counts from then at the earliest: a restart after a long outage does not release every
    worker as lost before its agent's next heartbeat.
    """
    runs = [
        PoolRun(run_id=r["run_id"], owner=r["owner"], min_peers=r["min_peers"], max_peers=r["max_peers"],
                submitted_at=r["submitted_at"], priority=r["priority"], share=r["share"],
                needs=Needs(device=r["need_device"] or "cpu", min_memory=int((r["need_memory_gib"] or 0.0) * _GIB)),
                state=RunState(r["state"]))
        for r in sorted(rows.runs, key=lambda r: (r["submitted_at"], r["run_id"]))
    ]  # fmt: skip
    workers = [
        Worker(worker_id=w["worker_id"], devices=_devices(w["resources"] or {}), last_seen=max(w["last_seen"], up_since),
               resident_present=bool(w["resident_present"]))
        for w in rows.workers
    ]
    assignments = [Assignment(worker_id=a["worker_id"], run_id=a["run_id"], since=a["since"]) for a in rows.assignments]
    return runs, workers, assignments


def finished_runs(rows: PoolRows) -> list[str]:
    """Running runs whose reported step reached their ``total_steps``: the loop marks them finished."""
    return [r["run_id"] for r in rows.runs
            if r["state"] == "running" and r["total_steps"] is not None and (r["step"] or 0) >= r["total_steps"]]


def carry_out(registry: Registry, actions: Sequence, runs: Sequence[PoolRun],
              emit: Callable[..., None] = lambda *a, **k: None) -> int:
    """Record ``plan``'s actions in order; returns how many were recorded.

    A Conflict (a user held or cancelled a run, a worker went elsewhere) stops the pass: the rest was planned
    from a state that no longer holds, and the next pass plans again from the registry.
    """
    states = {r.run_id: r.state.value for r in runs}
    done = 0
    for act in actions:
        try:
            if isinstance(act, Pause):
                registry.set_run_state(act.run_id, "paused", expect=states[act.run_id], reason=act.reason)
                states[act.run_id] = "paused"
            elif isinstance(act, Resume):
                registry.set_run_state(act.run_id, "running", expect=states[act.run_id], reason=act.reason)
                states[act.run_id] = "running"
            elif isinstance(act, Release):
                registry.unassign(act.worker_id, reason=act.reason)
            elif isinstance(act, Assign):
                registry.assign(act.worker_id, act.run_id, reason=act.reason)
        except (Conflict, RunNotFound) as e:
            logger.info(f"placement pass stopped at {type(act).__name__} of {act.run_id}: {e}")
            emit("placement_conflict", action=type(act).__name__, run_id=act.run_id, message=str(e))
            break
        done += 1
        logger.info(f"{type(act).__name__.lower()} run {act.run_id} {getattr(act, 'worker_id', '') or ''}: {act.reason}")
        emit("placement", action=type(act).__name__.lower(), run_id=act.run_id,
             worker_id=getattr(act, "worker_id", None), reason=act.reason)
    return done


def place_once(registry: Registry, policy: Policy, now: float, emit: Callable[..., None], up_since: float = 0.0) -> int:
    """One pass of the loop: finish runs that reached their last step, plan, record. Returns actions recorded."""
    rows = registry.pool()
    for run_id in finished_runs(rows):
        try:
            registry.set_run_state(run_id, "finished", expect="running", reason="reached total_steps")
            emit("placement", action="finish", run_id=run_id, worker_id=None, reason="reached total_steps")
        except Conflict:
            pass
    rows = registry.pool()
    runs, workers, assignments = placement_view(rows, up_since=up_since)
    return carry_out(registry, plan(now, runs, workers, assignments, policy), runs, emit)


async def _placement_loop(registry: Registry, config: CoordinatorConfig, wake: asyncio.Event, emit) -> None:
    up_since = time.time()
    while True:
        try:
            await asyncio.to_thread(place_once, registry, config.policy, time.time(), emit, up_since)
        except SwarmrunError as e:  # recorded, retried on the next pass (STYLE 5)
            logger.warning(f"placement pass failed: {e}")
        except Exception:
            logger.exception("placement pass failed")
        try:
            await asyncio.wait_for(wake.wait(), timeout=config.placement_interval)
        except asyncio.TimeoutError:
            pass
        wake.clear()


async def _keeper_loop(registry: Registry, keepers, config: CoordinatorConfig) -> None:
    """Keep one keeper per running run (``Keepers.reconcile`` runs in this loop's thread: the keepers' parent-death
    signal follows the thread that started them)."""
    try:
        while True:
            try:
                keepers.reconcile(await asyncio.to_thread(registry.runs))
            except Exception as e:  # tried again on the next pass (STYLE 5)
                logger.warning(f"keepers: {type(e).__name__}: {e}")
            await asyncio.sleep(2 * config.placement_interval)
    finally:
        await asyncio.to_thread(keepers.close)


def _keepers(registry: Registry, peer, config: CoordinatorConfig, emit):
    from swarmrun.coordinator.keepers import Keepers, keeper_listen
    from swarmrun.coordinator.owner import issue_certificate

    def certify(run_id: str, peer_id: str) -> str:
        return issue_certificate(registry.owner_key(run_id), run_id=run_id, peer_id=peer_id, now=time.time())

    return Keepers(config.state_dir, bootstrap=peer.maddrs, listen=keeper_listen(config.listen), certify=certify,
                   emit=emit)


async def _revocation_loop(registry: Registry, peer, config: CoordinatorConfig, emit, stop: Callable[[], None]) -> None:
    """Publish the runs' revocation lists as they fall due. If the coordinator's peer died, ``stop`` the service and
    end (SwarmrunError), rather than hand agents the address of a dead bootstrap peer."""
    while True:
        if not await asyncio.to_thread(peer.alive):
            stop()
            raise SwarmrunError("the coordinator's DHT peer died; restart the coordinator")
        try:
            await peer.publish_due(registry, time.time(), config.revoke_after, emit)
        except Exception as e:  # published on a later pass (STYLE 5): the registry holds what is due
            logger.warning(f"publishing revocations failed: {type(e).__name__}: {e}")
        await asyncio.sleep(config.placement_interval)


async def serve(config: CoordinatorConfig, events) -> None:
    """Run the coordinator until cancelled (SIGINT/SIGTERM stop uvicorn, which ends this)."""
    import uvicorn

    from swarmrun.coordinator.api import make_app
    from swarmrun.coordinator.peer import PoolPeer

    sock = _bind(config.host, config.port)  # first, not in uvicorn: a busy port is a usage error (exit 2)
    try:
        peer = await asyncio.to_thread(PoolPeer.start, config.state_dir / "peer", listen=config.listen,
                                       announce=config.announce)
    except BaseException:
        sock.close()
        raise
    from swarmrun.coordinator.owner import KeySeal

    registry = Registry(config.db_url, seal=KeySeal.at(config.state_dir))  # owner keys sealed under its state dir
    wake = asyncio.Event()
    app = make_app(registry, on_change=wake.set, store=config.store, pages=True,  # the dashboard on the same server
                   bootstrap=peer.maddrs)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           lifespan="off", access_log=False))

    def emit(kind: str, **fields) -> None:
        events.emit(kind, **fields)

    tasks: list[asyncio.Task] = []
    try:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        events.emit("serving", http=f"http://{config.host}:{config.port}", db=config.db_url, store=config.store,
                    peer_id=peer.peer_id, maddrs=list(peer.maddrs))
        tasks.append(asyncio.create_task(_placement_loop(registry, config, wake, emit)))
        revocations = asyncio.create_task(_revocation_loop(registry, peer, config, emit,
                                                           stop=lambda: setattr(server, "should_exit", True)))
        tasks.append(revocations)
        if config.keepers:
            tasks.append(asyncio.create_task(_keeper_loop(registry, _keepers(registry, peer, config, emit), config)))
        await serving
        if revocations.done():
            revocations.result()  # the peer died: raises why the service stopped
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        registry.close()
        await asyncio.to_thread(peer.shutdown)


def _bind(host: str, port: int):
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot serve on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def default_store(state_dir: Path) -> str:
    return str((state_dir / "store").resolve())
