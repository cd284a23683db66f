"""`node join`: create or join a run, bootstrap its state, train, leave cleanly.

Also the library entry point for an existing script: ``swarmrun.node.join.run_peer(...)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional

import torch
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from ..protocol.cursor import DataCursor
from ..protocol.errors import IncompatibleState, ProtocolError, RunNotFound, UsageError
from ..protocol.round import spec_key
from ..protocol.spec import SignedSpec, Spec
from .output import Events, set_log_context
from .state import RunState
from .swarm import SwarmConfig, public_key_bytes, start_dht, verify_signature
from .task import Task, TaskError, load_task_class
from ..protocol.access import MAX_TTL, Certificate
from .access import AccessGate, read_certificate_file
from .trainer import Trainer, TrainerConfig, _await, read_providers, read_view

if TYPE_CHECKING:
    from .snapshot_peer import SnapshotOptions

logger = logging.getLogger("swarmrun.join")
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEFAULT_SEED = 20261202
SPEC_TTL = 120.0


@dataclass(frozen=True, kw_only=True)
class JoinOptions:
    run_id: str
    task: Optional[str] = None  # create a new run of this task
    sets: Mapping[str, str] = field(default_factory=dict)
    seed: int = DEFAULT_SEED
    swarm: SwarmConfig
    trainer: TrainerConfig = TrainerConfig()
    resolve_timeout: float = 8.0  # how long to look for an existing run's spec
    resume_from: Optional[str] = None  # STORE[@STEP]: restart the run from a snapshot
    snapshot: Optional["SnapshotOptions"] = None  # --snapshot-to STORE ...
    access: str = "open"  # a new run's access policy: open or invite
    invite: Optional[str] = None  # a file with this peer's certificate (`node invite` output)


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id or ""):
        raise UsageError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '-' and '_'")
    return run_id


def resolve_device(name: str) -> str:
    """``cpu``, ``cuda`` (or ``cuda:N``) or ``auto``.

    Raises:
        UsageError: the device is not there.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise UsageError(f"device {name!r} requested but CUDA is not available on this machine")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return name
    raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, not {name!r}")


def make_spec(*, run_id: str, task_cls: type[Task], sets: Mapping[str, str], seed: int, owner_key: bytes,
              access: str = "open") -> tuple[Spec, Task]:
    """A new run's spec from ``--set key=value`` pairs (task arguments and hyperparameters).

    Raises:
        UsageError: a key that is neither, a value of the wrong type.
    """
    from .task import coerce_args

    task_sets = {k: v for k, v in sets.items() if k in task_cls.arg_defaults}
    hp_sets = {k: v for k, v in sets.items() if k in task_cls.hparam_defaults}
    unknown = sorted(set(sets) - set(task_sets) - set(hp_sets))
    if unknown:
        known = ", ".join(sorted({*task_cls.arg_defaults, *task_cls.hparam_defaults}))
        raise UsageError(f"unknown --set key(s) {', '.join(unknown)} for task {task_cls.name!r} (known: {known})")
    try:
        hparams = coerce_args(task_cls.hparam_defaults, hp_sets, what="hyperparameter")
        task = task_cls(task_sets, seed)
    except TaskError as e:
        raise UsageError(str(e)) from None
    for key in ("target_batch_size", "total_steps", "block_size"):
        if int(hparams[key]) <= 0:
            raise UsageError(f"{key} must be positive, got {hparams[key]}")
    spec = Spec(run_id=run_id, task=task_cls.name, task_version=task_cls.version, task_args=dict(task.args),
                hparams=hparams, seed=seed, data_fingerprint=task.data_fingerprint(),
                num_examples=task.num_examples(), owner_key=owner_key, access=access, created_at=time.time())
    return spec, task


def build_task_for(spec: Spec) -> Task:
    """Build the installed task a spec names, refusing another version or another dataset.

    Raises:
        IncompatibleState: task missing, other version, other data fingerprint.
    """
    try:
        task_cls = load_task_class(spec.task)
    except TaskError as e:
        raise IncompatibleState(f"run {spec.run_id!r} needs {e}") from None
    if task_cls.version != spec.task_version:
        raise IncompatibleState(f"run {spec.run_id!r} uses task {spec.task!r} version {spec.task_version}, "
                                f"this machine has version {task_cls.version}")
    try:
        task = task_cls(dict(spec.task_args), spec.seed)
    except TaskError as e:
        raise IncompatibleState(f"cannot build task {spec.task!r} of run {spec.run_id!r}: {e}") from None
    if task.data_fingerprint() != spec.data_fingerprint:
        raise IncompatibleState(
            f"this machine's data for task {spec.task!r} differs from the run's (fingerprint "
            f"{task.data_fingerprint()[:12]} != {spec.data_fingerprint[:12]}); use the same corpus (--set corpus=DIR on "
            f"the run's creator) and the same Python/library versions")
    return task


def initial_state(spec: Spec, task: Task, device: str) -> RunState:
    torch.manual_seed(spec.seed)  # only for tasks that use the global RNG (dropout); models derive from the seed
    model = task.build_model().to(device)
    optimizer = task.build_optimizer(model, spec.hparams)
    scheduler = task.build_scheduler(optimizer, spec.hparams)
    cursor = DataCursor.new(seed=spec.seed, num_examples=spec.num_examples, block_size=spec.block_size,
                            data_fingerprint=spec.data_fingerprint)
    return RunState(model=model, optimizer=optimizer, scheduler=scheduler, step=0, cursor=cursor,
                    spec_hash=spec.spec_hash(), seed=spec.seed)


async def fetch_spec(dht: DHT, run_id: str, *, timeout: float) -> Optional[SignedSpec]:
    """The run's signed spec from the DHT, verified; None if no peer has it within ``timeout``.

    Raises:
        IncompatibleState: a spec was found but does not verify or is malformed.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = await _await(dht.get(spec_key(run_id), latest=True, return_future=True))
        if found is not None:
            try:
                signed = SignedSpec.decode(found.value)
            except ProtocolError as e:
                raise IncompatibleState(f"the spec of run {run_id!r} in the swarm is malformed: {e}") from None
            signed.verify(verify_signature)
            if signed.spec.run_id != run_id:
                raise IncompatibleState(f"the spec stored for {run_id!r} names run {signed.spec.run_id!r}")
            return signed
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.5)


async def _publish_spec_forever(dht: DHT, signed: SignedSpec) -> None:
    """Every peer of a run keeps its signed spec in the DHT, so the run outlives its creator."""
    while True:
        try:
            await _await(dht.store(spec_key(signed.spec.run_id), signed.encode(), expiration_time=get_dht_time() + SPEC_TTL,
                            return_future=True))
        except Exception as e:
            logger.debug(f"could not publish spec: {e!r}")
        await asyncio.sleep(SPEC_TTL / 4)


async def run_peer(opts: JoinOptions, events: Events) -> str:
    """Create or join the run, then train until it finishes, ``max_steps`` is reached or a signal arrives.

    Returns:
        why the peer left ("finished", "max_steps", "stopped").
    Raises:
        SwarmrunError: with the exit code of the failure.
    """
    check_run_id(opts.run_id)
    from .snapshot_peer import SnapshotSide, SnapshotWriter, apply_resume, plan_resume
    from .swarm import ensure_identity

    creating = opts.task is not None
    resuming = opts.resume_from is not None
    if creating and resuming:
        raise UsageError("--task creates a new run and --resume-from restarts one from a snapshot: give one of them")
    if not creating and not resuming and not opts.swarm.initial_peers:
        raise UsageError("give --task NAME to create a new run, --resume-from STORE to restart one from a snapshot, "
                         "or --peers MADDR (or SWARMRUN_PEERS) to join one")
    credentials = read_certificate_file(opts.invite) if opts.invite else None
    if opts.access not in ("open", "invite"):
        raise UsageError(f"--access must be open or invite, got {opts.access!r}")
    if opts.access != "open" and not creating:
        raise UsageError("--access applies to a new run (with --task); a run keeps the policy it was created with")
    if opts.snapshot is not None:
        opts.snapshot.policy()  # a bad --snapshot-every or --snapshot-keep fails before anything starts
    plan = None
    if resuming:  # the snapshot is loaded and verified before the swarm starts: a bad one fails fast
        plan = await asyncio.to_thread(plan_resume, opts.resume_from, run_id=opts.run_id, sets=dict(opts.sets),
                                       key=ensure_identity(opts.swarm.state_dir)[1])
    task_cls = None
    if creating:
        try:
            task_cls = load_task_class(opts.task)
        except TaskError as e:
            raise UsageError(str(e)) from None
    device = resolve_device(opts.trainer.device)
    dht, key = await asyncio.to_thread(start_dht, opts.swarm, run_ids=(opts.run_id,))
    trainer: Optional[Trainer] = None
    spec_task = None
    try:
        peer_id = dht.peer_id.to_base58()
        set_log_context(run_id=opts.run_id, peer_id=peer_id)
        if creating:
            if opts.swarm.initial_peers and await fetch_spec(dht, opts.run_id, timeout=2.0) is not None:
                raise UsageError(f"run {opts.run_id!r} already exists at the given peers: join it without --task")
            spec, task = make_spec(run_id=opts.run_id, task_cls=task_cls, sets=opts.sets, seed=opts.seed,
                                   owner_key=public_key_bytes(key), access=opts.access)
            signed = SignedSpec.sign(spec, key.sign)
        elif resuming:
            if opts.swarm.initial_peers and await fetch_spec(dht, opts.run_id, timeout=2.0) is not None:
                raise UsageError(f"run {opts.run_id!r} is live at the given peers: join it with --peers, "
                                 f"without --resume-from")
            signed = plan.signed
            spec = signed.spec
            task = build_task_for(spec)
        else:
            if opts.sets:
                raise UsageError("--set applies to a new run (with --task); an existing run keeps its spec")
            signed = await fetch_spec(dht, opts.run_id, timeout=opts.resolve_timeout)
            if signed is None:
                raise RunNotFound(f"run {opts.run_id!r} was not found at the given peers")
            spec = signed.spec
            task = build_task_for(spec)
        spec_task = asyncio.create_task(_publish_spec_forever(dht, signed))
        state = initial_state(spec, task, device)
        expected_cursor = state.cursor  # counts this machine's data: what a received state's cursor must count
        if plan is not None:
            apply_resume(state, plan)
        gate = AccessGate(spec, credentials=credentials)
        if spec.access != "open":
            if spec.owner_key == public_key_bytes(key) and credentials is None:
                # the owner admits itself: it signs its own certificate
                gate.credentials = credentials = Certificate.issue(run_id=spec.run_id, peer_id=peer_id, now=time.time(),
                                                                   ttl=MAX_TTL, signer=key.sign).encode()
            await gate.refresh(dht)
            gate.check_self(peer_id)  # exit 4 with the reason before anything else
        trainer = Trainer(spec=spec, task=task, dht=dht, state=state, events=events, identity=key, gate=gate,
                          config=_with_device(opts.trainer, device))
        events.emit("listening", run_id=spec.run_id, peer_id=peer_id,
                    maddrs=[str(m) for m in dht.get_visible_maddrs()], spec_hash=spec.spec_hash(),
                    task=spec.task, created=creating)
        history = plan.history if plan is not None else ()
        writer = None
        if opts.snapshot is not None:
            writer = SnapshotWriter(trainer, options=opts.snapshot, signed=signed, history=history, events=events)
        side = SnapshotSide(trainer=trainer, signed=signed, history=history, events=events, writer=writer,
                            started_step=state.step)
        if plan is not None:
            events.emit("resumed", step=state.step, state_hash=trainer.state_hash, where=plan.snapshot.where,
                        manifest_hash=plan.snapshot.frozen.manifest.manifest_hash(),
                        cursor=state.cursor.summary(), amended=plan.changes)
        if not creating and not resuming:
            view = await read_view(dht, spec.run_id)
            if view.reports or await read_providers(dht, spec.run_id):
                t0 = time.perf_counter()
                how = await trainer.catch_up(deadline=time.monotonic() + opts.trainer.state_timeout)
                events.emit("bootstrapped", step=state.step, state_hash=trainer.state_hash,
                            seconds=round(time.perf_counter() - t0, 3), **how)
        # a state from a snapshot or from the swarm must count this machine's data (size, fingerprint, seed)
        trainer.state.cursor.check_same_data(expected_cursor)
        _install_signal_handlers(trainer)
        side.start()
        reason = await trainer.run()
        await side.close(reason)
        events.emit("left", reason=reason, step=trainer.state.step, state_hash=trainer.state_hash,
                    cursor=trainer.state.cursor.summary(), **trainer.stats)
        return reason
    finally:
        if spec_task is not None:
            spec_task.cancel()
        if trainer is not None:
            await trainer.stop_serving()
            await asyncio.to_thread(trainer.shutdown)
        await asyncio.to_thread(dht.shutdown)


def _with_device(config: TrainerConfig, device: str) -> TrainerConfig:
    from dataclasses import replace

    return replace(config, device=device)


LEAVE_GRACE = 30.0  # seconds a peer asked to leave may take before it is made to


def _install_signal_handlers(trainer: Trainer) -> None:
    """SIGINT/SIGTERM: leave gracefully (finish or abandon the round, last report, shutdown). A second signal, or a
    leave that takes longer than ``LEAVE_GRACE`` (a hivemind child killed by a signal to the whole group can
    leave a call hanging), ends the process and its children at once; the run's committed state lives on with
    the other peers and in snapshots."""
    loop = asyncio.get_running_loop()
    signals = {"count": 0}

    # a Python-level handler, not loop.add_signal_handler: it runs even when the loop is blocked (a hivemind child
    # killed by a signal to the whole group can die holding the averaged tensors' lock)
    def on_signal(signum, frame) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            _leave_now("a second signal")
        threading.Thread(target=_watchdog, daemon=True, name="leave-watchdog").start()
        loop.call_soon_threadsafe(trainer.stop_requested.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _watchdog() -> None:
    time.sleep(LEAVE_GRACE)
    _leave_now(f"a leave that took over {LEAVE_GRACE:.0f}s")


def _leave_now(why: str) -> None:
    from .swarm import kill_descendants

    logger.warning(f"leaving at once after {why}")
    try:
        kill_descendants(timeout=2.0)
    finally:
        os._exit(0)
