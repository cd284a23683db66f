"""The pool's commands: `node coordinator`, `node agent`, `node submit`, `node runs`, `node hold|release|cancel`.

Each imports ``swarmrun.coordinator`` only when it runs (SQLAlchemy and the web stack are not a peer's imports).
The API token comes from ``--token`` or ``SWARMRUN_TOKEN``, the coordinator's URL from ``--coordinator`` or
``SWARMRUN_COORDINATOR``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from swarmrun.node.cli.common import EXIT_CODES, parse_sets

_FMT = argparse.RawDescriptionHelpFormatter


def _common(p: argparse.ArgumentParser, *, client: bool = True) -> None:
    if client:
        p.add_argument("--coordinator", default=None, metavar="URL", help="the coordinator (default $SWARMRUN_COORDINATOR)")
        p.add_argument("--token", default=None, help="your API token (default $SWARMRUN_TOKEN)")
    p.add_argument("--state-dir", default=None, help="this command's directory (default ~/.swarmrun/<command>)")
    p.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")


def add_parsers(sub) -> None:
    c = sub.add_parser("coordinator", help="the pool service (HTTP API, registry, placement); `user add NAME`",
                       epilog=EXIT_CODES, formatter_class=_FMT)
    c.add_argument("words", nargs="*", metavar="user add NAME", help="add a user and print their API token")
    c.add_argument("--admin", action="store_true", help="with `user add`: the user may change every run")
    c.add_argument("--db", default=None, help="a SQLAlchemy URL (default: sqlite file coordinator.db in --state-dir)")
    c.add_argument("--http", default="127.0.0.1:8470", metavar="HOST:PORT", help="where the API listens")
    c.add_argument("--store", default=None, help="where pool runs' snapshots go (default <state-dir>/store)")
    c.add_argument("--min-residence", type=float, default=None, metavar="S",
                   help="seconds an assignment is kept from preemption and rebalancing (default 120)")
    c.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                   help="where the coordinator's peer listens, the pool runs' bootstrap point (default "
                        "/ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for a lab's workstations)")
    c.add_argument("--announce", nargs="+", default=None, metavar="MADDR", help="addresses its peer's dialers use")
    c.add_argument("--revoke-after", type=float, default=None, metavar="S",
                   help="seconds from a worker's release to the revocation of its peer's certificate, time for its "
                        "graceful leave (default 60)")
    c.add_argument("--no-keepers", action="store_true",
                   help="start no keeper (a `node keep` child holding each running run's newest state, so a run "
                        "whose trainers all vanish still has it beyond the store's last snapshot)")
    _common(c, client=False)

    a = sub.add_parser("agent", help="lend this workstation to a pool; `agent busy|idle` sets the resident flag",
                       epilog=EXIT_CODES, formatter_class=_FMT)
    a.add_argument("flag", nargs="?", choices=("busy", "idle"), help="set the `file` resident source's flag and exit")
    a.add_argument("--worker-id", default=None, help="this workstation's id in the pool (default: its host name)")
    a.add_argument("--resident", default="idle", metavar="script:FILE|file|idle[:S]",
                   help="how the resident's presence is read (default idle: Linux input idle time, 300 s)")
    a.add_argument("--device", default="auto", help="the device its peers train on (default auto)")
    a.add_argument("--peer-arg", dest="peer_args", action="append", default=[], metavar="ARG",
                   help="an argument passed to every peer's `node join` (repeatable; e.g. --peer-arg=--listen "
                        "--peer-arg=/ip4/0.0.0.0/tcp/0)")
    a.add_argument("--stop-timeout", type=float, default=20.0, help="SIGKILL a stopping peer after this (≤ 25 s)")
    _common(a)

    s = sub.add_parser("submit", help="submit a run to the pool", epilog=EXIT_CODES, formatter_class=_FMT)
    s.add_argument("run_id", metavar="RUN_ID")
    s.add_argument("--task", required=True)
    s.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--priority", default="normal", help="an integer, higher first, or low|normal|high (0|1|2)")
    s.add_argument("--min-peers", type=int, default=1)
    s.add_argument("--max-peers", type=int, default=None)
    s.add_argument("--share", type=float, default=1.0, help="weight of its fair share inside its priority")
    s.add_argument("--need-device", default=None, help="a device kind every peer must have (cuda)")
    _common(s)

    r = sub.add_parser("runs", help="the pool's runs", epilog=EXIT_CODES, formatter_class=_FMT)
    _common(r)
    for name, what in (("hold", "pause a run through the pool"), ("release", "let a held run be placed again"),
                       ("cancel", "end a run for good")):
        h = sub.add_parser(name, help=what, epilog=EXIT_CODES, formatter_class=_FMT)
        h.add_argument("run_id", metavar="RUN_ID")
        _common(h)


def _state_dir(args, name: str) -> Path:
    return Path(args.state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun" / name).expanduser()


def _client(args):
    from swarmrun.coordinator.client import Client, api_token, coordinator_url

    return Client(coordinator_url(args.coordinator), api_token(args.token))


def run_coordinator(args, events) -> int:
    from swarmrun.coordinator.placement import Policy
    from swarmrun.coordinator.registry import Registry, default_url
    from swarmrun.coordinator.service import CoordinatorConfig, default_store, parse_http, serve
    from swarmrun.protocol.errors import UsageError
    from swarmrun.node import run_async

    state_dir = _state_dir(args, "coordinator")
    state_dir.mkdir(parents=True, exist_ok=True)
    db = args.db or default_url(state_dir)
    if args.words:
        if len(args.words) != 3 or args.words[:2] != ["user", "add"]:
            raise UsageError("usage: node coordinator user add NAME [--admin]")
        registry = Registry(db)
        try:
            token = registry.add_user(args.words[2], admin=args.admin)
        finally:
            registry.close()
        if args.json:
            events.emit("user", name=args.words[2], admin=args.admin, token=token)
        else:
            print(token)
        return 0
    host, port = parse_http(args.http)
    policy = Policy() if args.min_residence is None else Policy(min_residence_s=args.min_residence)
    from swarmrun.node.net.swarm import parse_maddrs

    extra = {}
    if args.listen:
        extra["listen"] = parse_maddrs(args.listen, what="--listen")
    if args.announce:
        extra["announce"] = parse_maddrs(args.announce, what="--announce")
    if args.revoke_after is not None:
        if not args.revoke_after >= 0:
            raise UsageError("--revoke-after must be >= 0")
        extra["revoke_after"] = args.revoke_after
    extra["keepers"] = not args.no_keepers
    config = CoordinatorConfig(host=host, port=port, db_url=db, store=args.store or default_store(state_dir),
                               state_dir=state_dir, policy=policy, **extra)
    import signal

    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again under the handler it found: this
    # one, so a stop we were asked for exits 0 (everything is committed already)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_0)
    run_async(serve(config, events))
    return 0


def _exit_0(signum, frame) -> None:
    raise SystemExit(0)


def run_agent(args, events) -> int:
    from swarmrun.coordinator.residents import flag_path

    state_dir = _state_dir(args, "agent")
    state_dir.mkdir(parents=True, exist_ok=True)
    if args.flag is not None:
        flag = flag_path(state_dir)
        flag.touch() if args.flag == "busy" else flag.unlink(missing_ok=True)
        events.emit("resident", present=args.flag == "busy", flag=str(flag))
        return 0
    return _serve_agent(args, events, state_dir)


def _serve_agent(args, events, state_dir: Path) -> int:
    import asyncio
    import signal
    import socket

    from swarmrun.coordinator.agent import Agent, AgentConfig
    from swarmrun.coordinator.residents import make_resident
    from swarmrun.coordinator.schema import check_name
    from swarmrun.protocol.errors import UsageError
    from swarmrun.node import run_async

    if not 0 < args.stop_timeout <= 25:
        raise UsageError("--stop-timeout must be in (0, 25] seconds: the resident gets the machine back within 30 s")
    worker_id = args.worker_id or "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:64]
    config = AgentConfig(worker_id=check_name(worker_id, "--worker-id"), state_dir=state_dir.resolve(),
                         stop_timeout=args.stop_timeout, device=args.device, peer_args=tuple(args.peer_args))
    agent = Agent(config, _client(args), make_resident(args.resident, state_dir), events)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop.set)
        await agent.run()

    run_async(main())
    return 0


def run_submit(args, events) -> int:
    from swarmrun.coordinator.schema import parse_priority

    sets = parse_sets(args.sets)
    try:
        priority = parse_priority(int(args.priority))
    except ValueError:
        priority = parse_priority(args.priority)
    body = dict(run_id=args.run_id, task=args.task, task_args=sets, priority=priority, min_peers=args.min_peers,
                max_peers=args.max_peers or args.min_peers, share=args.share)
    if "total_steps" in sets and sets["total_steps"].isdigit():
        body["total_steps"] = int(sets["total_steps"])
    if args.need_device:
        body["needs"] = {"device": args.need_device}
    run = _client(args).post("runs", body)["run"]
    fields = {k: run[k] for k in ("run_id", "owner", "state", "priority", "min_peers", "max_peers")}
    _say(args, events, "submitted", fields, f"run {run['run_id']} submitted: {run['state']}, priority {run['priority']}, "
                                            f"{run['min_peers']}-{run['max_peers']} peers")
    return 0


def _say(args, events, kind: str, fields: dict, line: str) -> None:
    if args.json:
        events.emit(kind, **fields)
    else:
        print(line)


_COLUMNS = ("run_id", "owner", "state", "priority", "min_peers", "max_peers", "step", "total_steps", "loss", "snapshot_step")


def run_runs(args, events) -> int:
    runs = _client(args).get("runs")["runs"]
    if args.json:
        for run in runs:
            events.emit("run", **run)
        return 0
    events.table("", _COLUMNS, [["-" if run.get(c) is None else str(run[c]) for c in _COLUMNS] for run in runs])
    return 0


def run_action(args, events) -> int:
    from swarmrun.coordinator.schema import check_name

    run = _client(args).post(f"runs/{check_name(args.run_id)}/{args.command}")["run"]
    _say(args, events, args.command, dict(run_id=run["run_id"], state=run["state"]), f"run {run['run_id']}: {run['state']}")
    return 0
