"""The `node` command (also installed as `swarmrun`, for machines where `node` is Node.js)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .swarm import SwarmConfig

EXIT_CODES = """exit codes:
  0  done (the run finished, --max-steps reached, or the peer was asked to leave)
  1  unexpected error
  2  usage: a bad flag or value, an unknown task, a run that already exists, a busy port, an identity in use
  3  run not found, or no peer reachable
  4  access refused
  5  incompatible or corrupt state, spec or snapshot (another task version or corpus, a bad signature)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="node", description="swarmrun: a training run that outlives its machines.",
                                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    j = sub.add_parser("join", help="create (--task) or join (--peers) a run and train in it",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    j.add_argument("run_id", metavar="RUN_ID", help="the run's identity (letters, digits, '-', '_')")
    j.add_argument("--task", help="create a new run of this task (installed: see `node tasks`)")
    j.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a task argument or hyperparameter of a new run (repeatable)")
    j.add_argument("--seed", type=int, default=None, help="the new run's seed (default: a fixed one)")
    _swarm_args(j)
    j.add_argument("--batch-size", type=int, default=16, help="samples per local gradient computation (default 16)")
    j.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    j.add_argument("--max-steps", type=int, default=None, help="leave once the run reaches step N")
    j.add_argument("--min-peers", type=int, default=1, help="do not step until this many trainers are live")
    j.add_argument("--matchmaking-time", type=float, default=2.0, help="seconds to gather a group for a round")
    j.add_argument("--resume-from", default=None, metavar="STORE[@STEP]",
                   help="restart the run from a snapshot (the newest complete one, or STEP); --set may change "
                        "lr, target_batch_size, total_steps (owner's --state-dir only)")
    j.add_argument("--snapshot-to", default=None, metavar="STORE",
                   help="write snapshots of the run to this directory or fsspec URL (one peer is elected among "
                        "those with a store)")
    j.add_argument("--snapshot-every", default="auto", metavar="N|Nm|Ns|auto",
                   help="every N steps, N minutes or seconds, or auto: Young/Daly from the measured cost and "
                        "the observed failure rate (default). One write at a time: a step that commits while one "
                        "is in flight is skipped")
    j.add_argument("--snapshot-keep", type=int, default=3, metavar="K", help="keep the last K snapshots (default 3)")
    j.add_argument("--access", default="open", choices=("open", "invite"),
                   help="a new run's access policy: open (anyone who knows it; default) or invite (certificates "
                        "signed by the owner: `node invite`)")
    j.add_argument("--invite", default=None, metavar="FILE", help="this peer's certificate for an invite-only run")
    j.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    j.add_argument("-v", "--verbose", action="store_true", help="debug logs, hivemind's included")

    k = sub.add_parser("keep", help="hold and serve a run's state without training (a keeper: a CPU box, a lab server)",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("run_id", metavar="RUN_ID", help="the run to keep")
    _swarm_args(k)
    k.add_argument("--invite", default=None, metavar="FILE", help="this peer's certificate for an invite-only run")
    k.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    k.add_argument("-v", "--verbose", action="store_true", help="debug logs, hivemind's included")

    d = sub.add_parser("demo", help="a local swarm on loopback: trains, kills a peer, a fresh one joins",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    d.add_argument("--steps", type=int, default=60, help="total steps of the run (default 60)")
    d.add_argument("--task", default="char-lm", help="task of the run (default char-lm)")
    d.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--workdir", default=None, help="where peers keep state dirs and logs (default: a temp dir)")
    d.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")

    s = sub.add_parser("status", help="the swarm of a run as it stands: peers, steps, samples/s, roles",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("run_id", metavar="RUN_ID")
    _swarm_args(s, listen=False)
    s.add_argument("--json", action="store_true")

    sub.add_parser("tasks", help="list the installed tasks")
    from .snapshot_cli import add_parsers

    add_parsers(sub, epilog=EXIT_CODES, swarm_args=_swarm_args)
    from .access_cli import add_parsers as add_access_parsers

    add_access_parsers(sub, epilog=EXIT_CODES, swarm_args=_swarm_args)
    return p


def _swarm_args(p: argparse.ArgumentParser, listen: bool = True) -> None:
    p.add_argument("--peers", nargs="+", default=None, metavar="MADDR",
                   help="multiaddrs of peers of the run (default: $SWARMRUN_PEERS, space-separated)")
    p.add_argument("--state-dir", default=None,
                   help="this peer's directory (identity key); default ~/.swarmrun; two peers on a machine need two")
    if listen:
        p.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                       help="where to listen (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for other machines)")
        p.add_argument("--announce", nargs="+", default=None, metavar="MADDR", help="addresses others should dial")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # argparse exits 2 on a bad flag, with usage
    if args.command == "tasks":
        return _tasks()
    from ..protocol.errors import SwarmrunError
    from .output import Events, setup_logging

    json_mode = getattr(args, "json", False)
    setup_logging(json_mode=json_mode, verbose=getattr(args, "verbose", False))
    events = Events(json_mode=json_mode)
    try:
        if args.command == "join":
            return _join(args, events)
        if args.command in ("invite", "identity"):
            from .access_cli import run_command as run_access_command

            return run_access_command(args, events)
        if args.command == "keep":
            return _keep(args, events)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args, events)
        if args.command == "status":
            from .status import run_status

            return run_status(args, events)
        if args.command in ("snapshot", "pause"):
            from .snapshot_cli import run_command

            return run_command(args, events)
    except SwarmrunError as e:
        events.emit("error", code=e.exit_code, kind=type(e).__name__, message=str(e))
        return e.exit_code
    except KeyboardInterrupt:
        events.emit("error", code=1, kind="KeyboardInterrupt", message="interrupted")
        return 1
    except Exception as e:  # unexpected: one line for the user, the traceback with -v
        import logging

        logging.getLogger("swarmrun").debug("unexpected error", exc_info=True)
        events.emit("error", code=1, kind=type(e).__name__, message=f"unexpected: {e}")
        return 1
    finally:
        events.close()
        from .swarm import kill_descendants

        kill_descendants()
    return 2


def _tasks() -> int:
    from .task import available_tasks

    for name in sorted(available_tasks()):
        print(name)
    return 0


def swarm_config(args) -> "SwarmConfig":
    from ..protocol.errors import UsageError
    from .swarm import SwarmConfig, parse_maddrs

    peers = args.peers if args.peers is not None else os.environ.get("SWARMRUN_PEERS", "").split()
    state_dir = Path(args.state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun").expanduser()
    kwargs = dict(state_dir=state_dir, initial_peers=parse_maddrs(peers, what="--peers"))
    if getattr(args, "listen", None):
        kwargs["listen"] = parse_maddrs(args.listen, what="--listen")
    if getattr(args, "announce", None):
        kwargs["announce"] = parse_maddrs(args.announce, what="--announce")
    if not isinstance(state_dir, Path):
        raise UsageError("bad --state-dir")
    return SwarmConfig(**kwargs)


def parse_sets(pairs: Sequence[str]) -> dict[str, str]:
    from ..protocol.errors import UsageError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out


def _join(args, events) -> int:
    from ..protocol.errors import UsageError
    from .join import DEFAULT_SEED, JoinOptions, run_peer
    from .trainer import TrainerConfig

    if args.batch_size <= 0:
        raise UsageError("--batch-size must be positive")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps must be >= 0")
    if args.min_peers < 1:
        raise UsageError("--min-peers must be >= 1")
    if args.matchmaking_time <= 0:
        raise UsageError("--matchmaking-time must be positive")
    snapshot = None
    if args.snapshot_to is not None:
        from .snapshot_peer import SnapshotOptions

        snapshot = SnapshotOptions(store=args.snapshot_to, every=args.snapshot_every, keep=args.snapshot_keep)
    opts = JoinOptions(
        resume_from=args.resume_from, snapshot=snapshot,
        run_id=args.run_id, task=args.task, sets=parse_sets(args.sets), access=args.access, invite=args.invite,
        seed=args.seed if args.seed is not None else DEFAULT_SEED, swarm=swarm_config(args),
        trainer=TrainerConfig(batch_size=args.batch_size, device=args.device, max_steps=args.max_steps,
                              matchmaking_time=args.matchmaking_time, min_peers=args.min_peers),
    )
    _run_async(run_peer(opts, events))
    return 0


def _keep(args, events) -> int:
    from ..protocol.errors import UsageError
    from ..protocol.round import Role
    from .join import JoinOptions, run_peer
    from .trainer import TrainerConfig

    config = swarm_config(args)
    if not config.initial_peers:
        raise UsageError("give --peers MADDR (or SWARMRUN_PEERS) of a peer of the run to keep")
    opts = JoinOptions(run_id=args.run_id, swarm=config, trainer=TrainerConfig(role=Role.KEEPER, device="cpu"),
                       invite=args.invite)
    _run_async(run_peer(opts, events))
    return 0


def _run_async(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
