"""What the command groups share: the swarm flags, ``--set`` pairs, the exit-code epilog."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from swarmrun.node.net.swarm import SwarmConfig


EXIT_CODES = """exit codes:
  0  done (the run finished, --max-steps reached, or the peer was asked to leave)
  1  unexpected error
  2  usage: a bad flag or value, an unknown task, a run that already exists, a busy port, an identity in use
  3  run not found, or no peer reachable
  4  access refused
  5  incompatible or corrupt state, spec or snapshot (another task version or corpus, a bad signature)
"""


def swarm_args(p: argparse.ArgumentParser, listen: bool = True) -> None:
    p.add_argument("--peers", nargs="+", default=None, metavar="MADDR",
                   help="multiaddrs of peers of the run (default: $SWARMRUN_PEERS, space-separated)")
    p.add_argument("--state-dir", default=None,
                   help="this peer's directory (identity key); default ~/.swarmrun; two peers on a machine need two")
    if listen:
        p.add_argument("--listen", nargs="+", default=None, metavar="MADDR",
                       help="where to listen (default /ip4/127.0.0.1/tcp/0; /ip4/0.0.0.0/tcp/PORT for other machines)")
        p.add_argument("--announce", nargs="+", default=None, metavar="MADDR", help="addresses others should dial")


def require_peers(args, what: str = "of a peer of the run") -> None:
    """A command that needs the swarm refuses at once, before hivemind is imported, when no peer is given.

    Raises:
        UsageError: neither --peers nor SWARMRUN_PEERS.
    """
    from swarmrun.protocol.errors import UsageError

    if not (args.peers or os.environ.get("SWARMRUN_PEERS", "").split()):
        raise UsageError(f"give --peers MADDR (or SWARMRUN_PEERS) {what}")


def swarm_config(args) -> "SwarmConfig":
    from swarmrun.protocol.errors import UsageError
    from swarmrun.node.net.swarm import SwarmConfig, parse_maddrs

    peers = args.peers if args.peers is not None else os.environ.get("SWARMRUN_PEERS", "").split()
    state_dir = Path(args.state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun").expanduser()
    kwargs = dict(state_dir=state_dir, initial_peers=parse_maddrs(peers, what="--peers", peer_ids=True))
    if getattr(args, "listen", None):
        kwargs["listen"] = parse_maddrs(args.listen, what="--listen")
    if getattr(args, "announce", None):
        kwargs["announce"] = parse_maddrs(args.announce, what="--announce")
    if not isinstance(state_dir, Path):
        raise UsageError("bad --state-dir")
    return SwarmConfig(**kwargs)


def parse_sets(pairs: Sequence[str]) -> dict[str, str]:
    from swarmrun.protocol.errors import UsageError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out
