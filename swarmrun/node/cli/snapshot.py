"""`node snapshot ls|inspect|verify|export|import` and `node pause`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from swarmrun.protocol.errors import IncompatibleState, ProtocolError, RunNotFound, SwarmrunError, UsageError
from swarmrun.node.cli.common import require_peers

_FMT = argparse.RawDescriptionHelpFormatter


def add_parsers(sub, *, epilog: str, swarm_args: Callable) -> None:
    """The `snapshot` and `pause` commands of `node`."""
    s = sub.add_parser("snapshot", help="list, inspect, verify, export or import snapshots of runs",
                       epilog=epilog, formatter_class=_FMT)
    ss = s.add_subparsers(dest="snapshot_command", metavar="SUBCOMMAND")
    ss.required = True
    ls = ss.add_parser("ls", help="the snapshots in a store", epilog=epilog, formatter_class=_FMT)
    ls.add_argument("store", metavar="STORE", help="a directory or fsspec URL")
    ins = ss.add_parser("inspect", help="one snapshot: step, hashes, cursor, spec, history", epilog=epilog,
                        formatter_class=_FMT)
    ins.add_argument("ref", metavar="STORE[@STEP]", help="a store (its newest complete snapshot) or STORE@STEP")
    ver = ss.add_parser("verify", help="check every chunk of every snapshot in a store (exit 5 on any fault)",
                        epilog=epilog, formatter_class=_FMT)
    ver.add_argument("store", metavar="STORE")
    exp = ss.add_parser("export", help="the model weights of a snapshot as a .safetensors file", epilog=epilog,
                        formatter_class=_FMT)
    exp.add_argument("ref", metavar="STORE[@STEP]")
    exp.add_argument("--to", required=True, metavar="FILE", help="where to write (e.g. weights.safetensors)")
    exp.add_argument("--all", action="store_true", help="also the optimizer's tensors (names keep their prefix)")
    imp = ss.add_parser("import", help="a plain PyTorch checkpoint (model and optimizer state dicts) as a new run's "
                        "snapshot", epilog=epilog, formatter_class=_FMT)
    imp.add_argument("checkpoint", metavar="CKPT", help="torch.save'd dict with 'model' (and 'optimizer', 'step')")
    imp.add_argument("--task", required=True, help="the installed task whose model the checkpoint fits")
    imp.add_argument("--to", required=True, metavar="STORE", help="the snapshot store to write")
    imp.add_argument("--run-id", default=None, help="the run's id (default: the checkpoint's file name)")
    imp.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    imp.add_argument("--seed", type=int, default=None)
    imp.add_argument("--state-dir", default=None, help="holds the key that will own the run (default ~/.swarmrun)")
    for p in (ls, ins, ver, exp, imp):
        p.add_argument("--json", action="store_true", help="JSON lines on stdout")

    pz = sub.add_parser("pause", help="the run's owner asks the swarm to snapshot and leave; prints where",
                        epilog=epilog, formatter_class=_FMT)
    pz.add_argument("run_id", metavar="RUN_ID")
    swarm_args(pz)
    pz.add_argument("--to", default="", metavar="STORE", help="store every trainer can write to (default: the --snapshot-to of "
                    "the elected trainer; without one anywhere the pause is refused, exit 2)")
    pz.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the swarm (default 180)")
    pz.add_argument("--json", action="store_true")


def run_command(args, events) -> int:
    if args.command == "pause":
        return _pause(args, events)
    return {"ls": _ls, "inspect": _inspect, "verify": _verify, "export": _export,
            "import": _import}[args.snapshot_command](args, events)


def _print(events, event: str, fields: dict, human: str) -> None:
    if events.json_mode:
        events.emit(event, **fields)
    else:
        events.console.print(human, highlight=False, markup=False)


def _existing_store(url: str):
    from swarmrun.node.state.store import SnapshotStore

    store = SnapshotStore(url)
    if not store.steps():
        raise RunNotFound(f"no snapshot in {url}")
    return store


def describe(record, *, complete: bool = True) -> dict[str, Any]:
    """The summary of a snapshot record that `ls` and `inspect` print."""
    from swarmrun.protocol.cursor import DataCursor
    from swarmrun.protocol.snapshot import Amendment
    from swarmrun.protocol.spec import SignedSpec

    m = record.manifest
    try:
        spec = SignedSpec.decode(record.signed_spec).spec.to_dict()
        spec["owner_key"] = spec["owner_key"].hex()
    except ProtocolError as e:
        spec = {"error": str(e)}
    history = []
    for raw in record.history:
        try:
            a = Amendment.decode(raw)
            history.append(dict(step=a.step, changes=dict(a.changes), from_spec=a.from_spec, to_spec=a.to_spec))
        except ProtocolError as e:
            history.append({"error": str(e)})
    cursor = m.content.get("cursor")
    return dict(step=m.step, state_hash=m.state_hash(), manifest_hash=m.manifest_hash(), spec_hash=m.spec_hash,
                complete=complete, bytes=m.total_bytes, tensors=len(m.tensors), chunks=len(m.chunks),
                chunk_size=m.chunk_size, cursor=DataCursor.from_dict(cursor).summary() if cursor else None,
                writer=record.writer, written_at=record.written_at, spec=spec, history=history)


def _ls(args, events) -> int:
    store = _existing_store(args.store)
    for step in store.steps():
        try:
            d = describe(store.read_record(step), complete=store.complete(step))
            d = {k: d[k] for k in ("step", "state_hash", "manifest_hash", "complete", "bytes", "written_at", "writer")}
        except SwarmrunError as e:
            d = dict(step=step, complete=False, error=str(e))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d["written_at"])) if "written_at" in d else "-"
        _print(events, "snapshot", d, f"{args.store}@{step}  {when}  {d.get('bytes', '-')} bytes  "
               f"state {d.get('state_hash', '?')[:12]}  {'complete' if d['complete'] else 'INCOMPLETE: ' + d.get('error', 'chunks missing')}")
    return 0


def _inspect(args, events) -> int:
    from swarmrun.node.state.store import open_ref

    store, step = open_ref(args.ref)
    if step is None:
        step = store.newest_step()
    d = describe(store.read_record(step), complete=store.complete(step))
    d["where"] = f"{store.url}@{step}"
    if events.json_mode:
        events.emit("snapshot", **d)
        return 0
    for key in ("where", "step", "state_hash", "manifest_hash", "spec_hash", "complete", "bytes", "tensors", "chunks",
                "cursor", "writer", "history"):
        events.console.print(f"{key:>14}: {d[key]}", highlight=False, markup=False)
    spec = d["spec"]
    events.console.print(f"{'spec':>14}: run {spec.get('run_id')} task {spec.get('task')} v{spec.get('task_version')} "
                         f"hparams {spec.get('hparams')}", highlight=False, markup=False)
    return 0


def _verify(args, events) -> int:
    from swarmrun.protocol.spec import SignedSpec
    from swarmrun.node.net.swarm import verify_signature

    store = _existing_store(args.store)
    bad = 0
    for step, faults in store.verify().items():
        if not faults:
            try:
                signed = SignedSpec.decode(store.read_record(step).signed_spec)
                signed.verify(verify_signature)
                if signed.spec.spec_hash() != store.read_record(step).manifest.spec_hash:
                    faults = ["the state belongs to another spec than the snapshot's"]
            except (ProtocolError, IncompatibleState) as e:
                faults = [f"spec: {e}"]
        bad += bool(faults)
        _print(events, "verified", dict(step=step, ok=not faults, faults=faults),
               f"{args.store}@{step}: " + ("ok" if not faults else "; ".join(faults)))
    if bad:
        raise IncompatibleState(f"{bad} snapshot(s) in {args.store} failed verification")
    return 0


def _export(args, events) -> int:
    from safetensors.torch import save_file

    from swarmrun.node.state.store import open_ref

    store, step = open_ref(args.ref)
    snap = store.load(step)
    tensors = {(name if args.all else name[len("model/"):]): t.contiguous()
               for name, t in snap.frozen.tensors().items() if args.all or name.startswith("model/")}
    m = snap.frozen.manifest
    try:
        save_file(tensors, args.to, metadata={"swarmrun_snapshot": snap.where, "step": str(m.step),
                                              "state_hash": m.state_hash()})
    except OSError as e:
        raise SwarmrunError(f"cannot write {args.to}: {e.strerror or e}") from None
    _print(events, "exported", dict(where=snap.where, to=args.to, step=m.step, tensors=len(tensors),
                                    state_hash=m.state_hash()),
           f"wrote {len(tensors)} tensors of {snap.where} to {args.to}")
    return 0


def _import(args, events) -> int:
    import re

    from swarmrun.node.cli.common import parse_sets, swarm_config
    from swarmrun.node.peer.build import DEFAULT_SEED, initial_state, make_spec
    from swarmrun.protocol.spec import check_run_id
    from swarmrun.node.state.store import SnapshotStore
    from swarmrun.node.net.swarm import ensure_identity, public_key_bytes
    from swarmrun.protocol.errors import TaskError
    from swarmrun.node.tasks.base import load_task_class
    from swarmrun.protocol.spec import SignedSpec

    run_id = check_run_id(args.run_id or re.sub(r"[^A-Za-z0-9_-]", "-", Path(args.checkpoint).stem)[:64])
    try:
        task_cls = load_task_class(args.task)
    except TaskError as e:
        raise UsageError(str(e)) from None
    ckpt = _load_checkpoint(args.checkpoint)
    args.peers, args.listen, args.announce = [], None, None
    key = ensure_identity(swarm_config(args).state_dir)[1]
    spec, task = make_spec(run_id=run_id, task_cls=task_cls, sets=parse_sets(args.sets),
                           seed=args.seed if args.seed is not None else DEFAULT_SEED, owner_key=public_key_bytes(key))
    state = initial_state(spec, task, "cpu")
    try:
        state.model.load_state_dict(ckpt["model"], strict=True)
        # in outer mode the checkpoint's optimizer is an inner one: the peer's own, not the run's (which starts fresh)
        if ckpt.get("optimizer") is not None and state.inner is None:
            state.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise IncompatibleState(f"{args.checkpoint} does not fit task {args.task!r}: {str(e).splitlines()[0]}") from None
    step = ckpt.get("step", 0)
    if not isinstance(step, int) or step < 0:
        raise IncompatibleState(f"{args.checkpoint}: 'step' must be a non-negative int")
    state.step = step
    sched = state.scheduler
    sched.last_epoch = step  # the schedule continues where the checkpoint left it
    if hasattr(sched, "lr_lambdas"):
        groups = getattr(sched, "optimizer", state.optimizer).param_groups  # outer mode: the inner optimizer's
        for g, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(step)
        sched._last_lr = [g["lr"] for g in groups]
    frozen = state.freeze()
    result = SnapshotStore(args.to).write(frozen, signed_spec=SignedSpec.sign(spec, key.sign).encode(),
                                          writer="import")
    _print(events, "imported", dict(where=result.where, run_id=run_id, step=step, state_hash=frozen.manifest.state_hash(),
                                    optimizer=ckpt.get("optimizer") is not None),
           f"imported {args.checkpoint} as run {run_id!r} step {step}: {result.where} "
           f"(node join {run_id} --resume-from {args.to})")
    return 0


def _load_checkpoint(path: str) -> dict:
    import pickle

    import torch

    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)  # no arbitrary unpickling
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} does not exist") from None
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as e:
        raise IncompatibleState(f"{path} is not a plain PyTorch checkpoint: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise IncompatibleState(f"{path} holds a {type(raw).__name__}, expected a dict of state dicts")
    model = raw.get("model", raw.get("model_state_dict"))
    if model is None and raw and all(isinstance(v, torch.Tensor) for v in raw.values()):
        model = raw  # a bare model state dict
    if not isinstance(model, dict):
        raise IncompatibleState(f"{path} has no 'model' state dict")
    return dict(model=model, optimizer=raw.get("optimizer", raw.get("optimizer_state_dict")), step=raw.get("step", 0))


# ---- pause ------------------------------------------------------------------------------------------------
def _pause(args, events) -> int:
    from swarmrun.node.runtime import run_async as run_async
    from swarmrun.node.cli.common import swarm_config
    from swarmrun.protocol.spec import check_run_id
    from swarmrun.node.net.swarm import ensure_identity

    check_run_id(args.run_id)
    require_peers(args)
    config = swarm_config(args)
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    key = ensure_identity(config.state_dir)[1]
    result = run_async(pause_run(args.run_id, config.initial_peers, key=key, store=args.to, timeout=args.timeout,
                                  listen=config.listen))
    _print(events, "paused", result, f"run {args.run_id} paused at step {result['step']}: {result['where']}\n"
           f"resume with: node join {args.run_id} --resume-from {result['where']}")
    return 0


async def pause_run(run_id: str, initial_peers, *, key, store: str, timeout: float,
                    listen=("/ip4/127.0.0.1/tcp/0",)) -> dict:
    """Sign a pause record, publish it, wait until a snapshot is written and the trainers left.

    Raises:
        RunNotFound: run or peers not found. AccessRefused: ``key`` is not the run's owner.
        SwarmrunError: the swarm did not pause within ``timeout``.
    """
    from hivemind.utils.timed_storage import get_dht_time

    from swarmrun.protocol.snapshot import PauseNote, PauseRecord, pause_key, paused_key, trainer_notes
    from swarmrun.node.peer.access import AccessGate
    from swarmrun.node.net.records import owner_session, owner_subkey, read_subkeys, read_view, store_own

    # the session is a full DHT node: the peers' notes must outlive the peers, which leave right after
    async with owner_session(run_id, initial_peers, key, action="pause it", listen=listen) as (dht, signed):
        spec = signed.spec
        gate = AccessGate(spec)  # in an invite-only run, a trainer is a peer with a certificate
        await gate.refresh(dht)
        view = await read_view(dht, run_id, gate)
        trainers = {p for p, r in view.trainers.items() if not r.finished}
        if not trainers:
            raise RunNotFound(f"run {run_id!r} has no live trainer to pause")
        if not store and not any(view.trainers[p].snapshots for p in trainers):
            raise UsageError(f"no live trainer of run {run_id!r} takes snapshots (none was started with "
                             f"--snapshot-to): give --to STORE, a directory or URL every trainer can write to; "
                             f"nothing was paused")
        record = PauseRecord(run_id=run_id, spec_hash=spec.spec_hash(), at_step=view.newest_step + 1, store=store,
                             time=get_dht_time())
        record = dataclasses.replace(record, signature=bytes(key.sign(record.unsigned_bytes())))
        deadline = time.monotonic() + timeout
        written = None
        notes: dict = {}
        published = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - published > 30:
                # the owner's signed subkey: no one else writes or hides it
                stored = await store_own(dht, pause_key(run_id), record.encode(), owner_subkey(spec.owner_key), 120)
                published = time.monotonic() if stored else 0.0  # not accepted: publish it again next turn
            live = {p for p, r in (await read_view(dht, run_id, gate)).trainers.items() if not r.finished}
            # only the trainers' own signed notes count: a stranger's "left, written to STORE@..." is ignored
            notes = trainer_notes(await read_subkeys(dht, paused_key(run_id), PauseNote.decode, signed=True),
                                  trainers=trainers | live, step=record.at_step)
            # the newest step written (a round in flight when the pause came may have committed one more on some)
            written = max((n for n in (written, *notes.values()) if n and n.where), key=lambda n: n.step, default=None)
            waiting = {p for p in trainers & live if not (notes.get(p) and notes[p].left)}
            if written is not None and not waiting:
                break
            if written is None and trainers and all(notes.get(p) and notes[p].left for p in trainers):
                errors = sorted({n.error for n in notes.values() if n.error})  # every peer gave up writing
                raise SwarmrunError(f"run {run_id!r} stopped but no snapshot could be written: {'; '.join(errors)}")
            await asyncio.sleep(0.5)
        else:
            failed = sorted({n.error for n in notes.values() if n.error}) if notes else []
            raise SwarmrunError(f"run {run_id!r} did not pause within {timeout:g}s "
                                f"({'no snapshot written yet' if written is None else 'peers still live'}"
                                f"{': ' + '; '.join(failed) if failed else ''})")
        return dict(run_id=run_id, step=written.step, where=written.where, state_hash=written.state_hash,
                    manifest_hash=written.manifest_hash, peers=len(trainers))
