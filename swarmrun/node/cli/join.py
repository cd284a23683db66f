"""`node join` and `node keep`: a peer of a run, training or keeping its state."""

from __future__ import annotations

import argparse

from swarmrun.node.cli.common import EXIT_CODES, parse_sets, require_peers, swarm_args, swarm_config
from swarmrun.node.runtime import run_async

_FMT = argparse.RawDescriptionHelpFormatter


def add_parsers(sub) -> None:
    j = sub.add_parser("join", help="create (--task) or join (--peers) a run and train in it",
                       epilog=EXIT_CODES, formatter_class=_FMT)
    j.add_argument("run_id", metavar="RUN_ID", help="the run's identity (letters, digits, '-', '_')")
    j.add_argument("--task", help="create a new run of this task (installed: see `node tasks`)")
    j.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a task argument or hyperparameter of a new run (repeatable); outer mode: --set outer=diloco "
                        "--set inner_steps=H [--set outer_lr=0.7 --set outer_momentum=0.9 --set outer_nesterov=true]")
    j.add_argument("--seed", type=int, default=None, help="the new run's seed (default: a fixed one)")
    j.add_argument("--total-samples", type=int, default=None, metavar="N",
                   help="a new run's length in samples instead of steps (= --set total_samples=N): it ends with the "
                        "step whose samples reach N (that step is not trimmed: up to one step's samples more)")
    j.add_argument("--epochs", type=int, default=None, metavar="N",
                   help="a new run's length in whole passes over its dataset (= --set epochs=N; ends exactly there)")
    swarm_args(j)
    j.add_argument("--batch-size", type=int, default=16, help="samples per local gradient computation (default 16)")
    j.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    j.add_argument("--max-steps", type=int, default=None, help="leave once the run reaches step N")
    j.add_argument("--min-peers", type=int, default=1,
                   help="do not step until this many trainers are live; once they were, go on with fewer but never alone")
    j.add_argument("--alone-after", type=float, default=60.0, metavar="SECONDS",
                   help="after other trainers vanished without saying they left (a crash or a partition: the same "
                        "from here), wait this long before stepping alone (default 60)")
    j.add_argument("--matchmaking-time", type=float, default=2.0, help="seconds to gather a group for a round")
    j.add_argument("--resume-from", default=None, metavar="STORE[@STEP]",
                   help="restart the run from a snapshot (the newest complete one, or STEP); --set may change "
                        "lr, target_batch_size and the length: total_steps, total_samples or epochs (owner's "
                        "--state-dir only)")
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
    j.add_argument("--spec", default=None, metavar="FILE",
                   help="create the run from this signed spec, its owner's key elsewhere (a pool's coordinator signs "
                        "the specs of its runs and hands them to its agents)")
    j.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    j.add_argument("-v", "--verbose", action="store_true", help="debug logs, hivemind's included")

    k = sub.add_parser("keep", help="hold and serve a run's state without training (a keeper: a CPU box, a lab server)",
                       epilog=EXIT_CODES, formatter_class=_FMT)
    k.add_argument("run_id", metavar="RUN_ID", help="the run to keep")
    swarm_args(k)
    k.add_argument("--invite", default=None, metavar="FILE", help="this peer's certificate for an invite-only run")
    k.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    k.add_argument("-v", "--verbose", action="store_true", help="debug logs, hivemind's included")


def run_join(args, events) -> int:
    from swarmrun.protocol.errors import UsageError

    if args.batch_size <= 0:
        raise UsageError("--batch-size must be positive")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps must be >= 0")
    if args.min_peers < 1:
        raise UsageError("--min-peers must be >= 1")
    if args.alone_after < 0:
        raise UsageError("--alone-after must be >= 0")
    if args.matchmaking_time <= 0:
        raise UsageError("--matchmaking-time must be positive")
    sets = parse_sets(args.sets)
    for key, value in (("total_samples", args.total_samples), ("epochs", args.epochs)):
        if value is not None:
            if value <= 0 or sets.get(key, str(value)) != str(value):
                raise UsageError(f"--{key.replace('_', '-')} must be positive and agree with --set {key}")
            sets[key] = str(value)
    # only now torch and hivemind: a usage error comes at once (issue 19: every mistyped value took seconds)
    from swarmrun.node.peer.build import DEFAULT_SEED
    from swarmrun.node.peer.join import JoinOptions, run_peer
    from swarmrun.node.peer.trainer import TrainerConfig

    snapshot = None
    if args.snapshot_to is not None:
        from swarmrun.node.peer.snapshots import SnapshotOptions

        snapshot = SnapshotOptions(store=args.snapshot_to, every=args.snapshot_every, keep=args.snapshot_keep)
    opts = JoinOptions(
        resume_from=args.resume_from, snapshot=snapshot,
        run_id=args.run_id, task=args.task, sets=sets, access=args.access, invite=args.invite, spec=args.spec,
        seed=args.seed if args.seed is not None else DEFAULT_SEED, swarm=swarm_config(args),
        trainer=TrainerConfig(batch_size=args.batch_size, device=args.device, max_steps=args.max_steps,
                              matchmaking_time=args.matchmaking_time, min_peers=args.min_peers,
                              alone_after=args.alone_after),
    )
    run_async(run_peer(opts, events))
    return 0


def run_keep(args, events) -> int:
    from swarmrun.protocol.round import Role
    from swarmrun.node.peer.join import JoinOptions, run_peer
    from swarmrun.node.peer.trainer import TrainerConfig

    require_peers(args, "of a peer of the run to keep")
    config = swarm_config(args)
    opts = JoinOptions(run_id=args.run_id, swarm=config, trainer=TrainerConfig(role=Role.KEEPER, device="cpu"),
                       invite=args.invite)
    run_async(run_peer(opts, events))
    return 0
