"""`node invite` and `node identity`: the owner signs certificates and revocations; a peer shows, backs up and
restores the key that is both its p2pd identity and its signing key."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

from swarmrun.protocol.access import Certificate, parse_ttl, revoke
from swarmrun.protocol.errors import AccessRefused, UsageError


def add_parsers(sub, *, epilog: str, swarm_args) -> None:
    import argparse

    fmt = argparse.RawDescriptionHelpFormatter
    inv = sub.add_parser(
        "invite", epilog=epilog, formatter_class=fmt,
        help="as a run's owner: print a certificate that lets one peer join an invite-only run (or revoke one)",
        description="node invite RUN_ID --peer PEER_ID [--ttl 7d] [--out FILE]\n"
                    "node invite revoke RUN_ID --peer PEER_ID --peers MADDR [--undo]\n\n"
                    "Uses the key in --state-dir, which must be the run's owner (the peer that created it).")
    inv.add_argument("words", nargs="+", metavar="[revoke] RUN_ID", help="the run (after `revoke` to revoke)")
    inv.add_argument("--peer", required=True, action="append", metavar="PEER_ID",
                     help="the peer id to invite or revoke (the invitee prints it with `node identity show`)")
    inv.add_argument("--ttl", default="7d", help="how long the certificate is valid (30m, 12h, 7d; default 7d)")
    inv.add_argument("--out", default=None, metavar="FILE", help="write the certificate to FILE (default: print it)")
    inv.add_argument("--undo", action="store_true", help="with revoke: lift an earlier revocation")
    swarm_args(inv, listen=False)
    inv.add_argument("--json", action="store_true")

    ident = sub.add_parser("identity", epilog=epilog, formatter_class=fmt,
                           help="this peer's key: show its peer id, back it up, restore it")
    ident.add_argument("action", choices=("show", "export", "import"))
    ident.add_argument("file", nargs="?", metavar="FILE", help="export: where to write; import: what to read")
    ident.add_argument("--state-dir", default=None, help="the peer's directory (default ~/.swarmrun)")
    ident.add_argument("--force", action="store_true", help="import: replace an existing identity")
    ident.add_argument("--json", action="store_true")


def _state_dir(args) -> Path:
    return Path(args.state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun").expanduser()


def run_command(args, events) -> int:
    if args.command == "identity":
        return _identity(args, events)
    return _invite(args, events)


def _identity(args, events) -> int:
    from hivemind.p2p import PeerID

    from swarmrun.node.net.swarm import IDENTITY_FILE, ensure_identity

    state_dir = _state_dir(args)
    path = state_dir / IDENTITY_FILE
    if args.action == "import":
        if not args.file:
            raise UsageError("node identity import FILE")
        source = Path(args.file).expanduser()
        try:
            PeerID.from_identity(source.read_bytes())
        except OSError as e:
            raise UsageError(f"cannot read {source}: {e.strerror}") from None
        except Exception:
            raise UsageError(f"{source} is not a swarmrun/libp2p identity key") from None
        if path.exists() and not args.force:
            raise UsageError(f"{path} exists; give --force to replace it (back it up first with `node identity export`)")
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    elif not path.exists() and args.action == "export":
        raise UsageError(f"no identity in {state_dir} to export")
    identity_path, _ = ensure_identity(state_dir)
    peer_id = PeerID.from_identity(Path(identity_path).read_bytes()).to_base58()
    if args.action == "export":
        if not args.file:
            raise UsageError("node identity export FILE")
        target = Path(args.file).expanduser()
        if target.exists():
            raise UsageError(f"{target} exists; not overwriting a key file")
        try:
            shutil.copyfile(identity_path, target)
            os.chmod(target, 0o400)
        except OSError as e:
            raise UsageError(f"cannot write {target}: {e.strerror}") from None
    events.emit("identity", peer_id=peer_id, state_dir=str(state_dir),
                **({"file": str(Path(args.file).expanduser())} if args.file else {}))
    return 0


def _invite(args, events) -> int:
    from swarmrun.node.peer.access import certificate_text
    from swarmrun.protocol.spec import check_run_id
    from swarmrun.node.net.swarm import ensure_identity

    words = list(args.words)
    revoking = words[0] == "revoke"
    if revoking:
        words = words[1:]
    if len(words) != 1:
        raise UsageError("give one RUN_ID: node invite RUN_ID --peer PEER_ID, or node invite revoke RUN_ID --peer PEER_ID")
    run_id = check_run_id(words[0])
    for peer in args.peer:
        if not (20 <= len(peer) <= 128 and peer.isalnum()):
            raise UsageError(f"{peer!r} is not a peer id (the invitee prints it with `node identity show`)")
    _, key = ensure_identity(_state_dir(args))
    if revoking:
        from swarmrun.node.runtime import run_async as run_async
        from swarmrun.node.cli.common import swarm_config

        config = swarm_config(args)
        if not config.initial_peers:
            raise UsageError("revoking needs the swarm: give --peers MADDR of a peer of the run")
        revoked = run_async(_publish_revocation(run_id, args.peer, config.initial_peers, key, undo=args.undo))
        events.emit("revoked", run_id=run_id, revoked=sorted(revoked), undo=args.undo)
        return 0
    _check_owner(run_id, _state_dir(args), key)
    try:
        ttl = parse_ttl(args.ttl)
        cert = Certificate.issue(run_id=run_id, peer_id=args.peer[0], now=time.time(), ttl=ttl, signer=key.sign)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(args.peer) != 1:
        raise UsageError("one --peer per certificate")
    text = certificate_text(cert)
    if args.out:
        try:
            Path(args.out).expanduser().write_text(text + "\n")
        except OSError as e:
            raise UsageError(f"cannot write {args.out}: {e.strerror}") from None
    if events.json_mode:
        events.emit("invite", run_id=run_id, peer_id=cert.peer_id, expires_at=cert.expires_at, certificate=text,
                    file=args.out)
    elif args.out:
        events.console.print(f"invite for {cert.peer_id} to run {run_id} written to {args.out}; valid until "
                             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cert.expires_at))}")
    else:
        print(text)
    return 0


def _check_owner(run_id: str, state_dir: Path, key) -> None:
    """Refuse to sign an invite no peer would accept: this state dir's key must be the run's owner.

    Raises:
        AccessRefused: the state dir did not create (or resume) the run, or its spec names another owner.
    """
    from swarmrun.node.net.swarm import public_key_bytes
    from swarmrun.node.state.owned import owned_spec

    signed = owned_spec(state_dir, run_id)
    if signed is None or signed.spec.owner_key != public_key_bytes(key):
        raise AccessRefused(f"the key in {state_dir} is not the owner of run {run_id!r} (no run of that id was "
                            f"created or resumed from this --state-dir); invites must be signed by the owner's key: "
                            f"run `node invite` with the --state-dir of the peer that created the run")


async def _publish_revocation(run_id: str, peers, initial_peers, key, *, undo: bool) -> frozenset[str]:
    from swarmrun.node.peer.access import AccessGate
    from swarmrun.node.net.records import publish_revocations
    from swarmrun.node.net.records import owner_session

    async with owner_session(run_id, initial_peers, key, action="revoke") as (dht, signed):
        gate = AccessGate(signed.spec)
        await gate.refresh(dht)
        revocations = revoke(gate.revocations, run_id=run_id, peers=peers, now=time.time(), signer=key.sign,
                             unrevoke=undo)
        await publish_revocations(dht, revocations, signed.spec.owner_key)
        await asyncio.sleep(1.0)  # let the store reach the run's peers before this node leaves
        return revocations.revoked
