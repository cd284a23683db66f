"""`node join`: create or join a run, bootstrap its state, train, leave cleanly.

Also the library entry point for an existing script: ``swarmrun.node.run_peer(...)``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from hivemind import DHT

from swarmrun.node.net.records import anchor_ids, fetch_spec, publish_spec_forever, read_providers, read_view
from swarmrun.node.net.swarm import (SwarmConfig, ensure_identity, public_key_bytes, record_validator, signed_subkey,
                                     start_dht, verify_signature)
from swarmrun.node.runtime import kill_descendants
from swarmrun.node.output import Events, set_log_context
from swarmrun.node.peer.access import AccessGate, read_certificate_file
from swarmrun.node.peer.build import DEFAULT_SEED, build_task_for, initial_state, make_spec, resolve_device
from swarmrun.protocol.spec import check_run_id
from swarmrun.node.peer.snapshots import SnapshotSide, SnapshotWriter, apply_resume, plan_resume
from swarmrun.node.peer.trainer import Trainer, TrainerConfig
from swarmrun.node.state.owned import remember_owned
from swarmrun.node.tasks.base import Task, load_task_class
from swarmrun.protocol.access import MAX_TTL, Certificate
from swarmrun.protocol.errors import IncompatibleState, ProtocolError, RunNotFound, Stopped, TaskError, UsageError
from swarmrun.protocol.round import Role
from swarmrun.protocol.spec import SignedSpec

if TYPE_CHECKING:
    from swarmrun.node.peer.snapshots import ResumePlan, SnapshotOptions

logger = logging.getLogger("swarmrun.join")
EXISTS_TIMEOUT = 2.0  # a new or resumed run's look for a live run of the same id at the given peers


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
    spec: Optional[str] = None  # create the run from this file's signed spec (its owner is elsewhere: a pool's coordinator)


async def run_peer(opts: JoinOptions, events: Events, *, keep: Optional[dict] = None) -> str:
    """Create or join the run, then train until it finishes, ``max_steps`` is reached or a signal arrives.

    Args:
        keep: filled, when the peer leaves after training, with its ``model``, ``step`` and ``state_hash``.
    Returns:
        why the peer left ("finished", "max_steps", "stopped").
    Raises:
        SwarmrunError: with the exit code of the failure.
    """
    _check_options(opts)
    signals = LeaveSignals(asyncio.Event())
    signals.install()  # at once: a SIGINT to this pid alone must stop a peer that is still starting
    try:
        return await _run_peer(opts, events, keep, signals)
    except Exception as e:
        if not signals.stop.is_set():
            raise
        logger.debug(f"while leaving on a signal: {e!r}")  # hivemind's children got the group's signal too
        return _left_early(events)
    finally:
        signals.restore()


async def _run_peer(opts: JoinOptions, events: Events, keep: Optional[dict], signals: "LeaveSignals") -> str:
    stop = signals.stop
    credentials = read_certificate_file(opts.invite) if opts.invite else None
    plan, task_cls = await _local_inputs(opts)
    device = resolve_device(opts.trainer.device)
    dht, key = await asyncio.to_thread(start_dht, opts.swarm, run_ids=(opts.run_id,))
    trainer: Optional[Trainer] = None
    spec_task = None
    try:
        peer_id = dht.peer_id.to_base58()
        set_log_context(run_id=opts.run_id, peer_id=peer_id)
        if stop.is_set():
            return _left_early(events)
        signed, task = await _resolve_spec(opts, dht, key, plan, task_cls)
        if stop.is_set():
            return _left_early(events)
        spec = signed.spec
        if spec.owner_key == public_key_bytes(key):
            remember_owned(opts.swarm.state_dir, signed)  # `node invite` from this state dir can tell it owns the run
        spec_subkey = signed_subkey(record_validator(key), peer_id)  # a joiner takes the spec from its --peers
        spec_task = asyncio.create_task(publish_spec_forever(dht, signed, spec_subkey))
        state = initial_state(spec, task, device)
        expected_cursor = state.cursor  # counts this machine's data: what a received state's cursor must count
        if plan is not None:
            apply_resume(state, plan)
        gate = await _admit_self(spec, dht, key, peer_id, credentials)
        trainer = Trainer(spec=spec, task=task, dht=dht, state=state, events=events, identity=key, gate=gate,
                          config=replace(opts.trainer, device=device), stop_requested=stop)
        signals.install()  # again: starting hivemind's averager set SIGINT to "ignore" in this process
        events.emit("listening", run_id=spec.run_id, peer_id=peer_id,
                    maddrs=[str(m) for m in dht.get_visible_maddrs()], spec_hash=spec.spec_hash(),
                    task=spec.task, created=opts.task is not None or opts.spec is not None)
        side = _snapshot_side(opts, trainer, signed, plan, events)
        try:
            await _bootstrap(opts, trainer, plan, events)
        except Stopped:
            return _left_early(events)
        if stop.is_set():
            return _left_early(events)
        # a state from a snapshot or from the swarm must count this machine's data (size, fingerprint, seed)
        trainer.state.cursor.check_same_data(expected_cursor)
        side.start()
        reason = await trainer.run()
        try:
            await side.close(reason)
        except Exception as e:  # the leave goes on: the `left` event and the exit code say how it ended
            logger.warning(f"the snapshot side failed while leaving: {type(e).__name__}: {e}")
        if reason in ("stopped", "max_steps") and trainer.config.role == Role.TRAINER \
                and not await trainer.reporter.hand_to_keepers(trainer.state.step, KEEPER_HANDOFF):
            logger.warning(f"leaving with the run's keeper still behind step {trainer.state.step}")
        _left(trainer, reason, events, keep)
        return reason
    finally:
        if spec_task is not None:
            spec_task.cancel()
        if trainer is not None:
            await trainer.served.stop()
            await asyncio.to_thread(trainer.shutdown)
        await asyncio.to_thread(dht.shutdown)


async def _local_inputs(opts: JoinOptions) -> tuple[Optional["ResumePlan"], Optional[type[Task]]]:
    """What needs no swarm, checked before the swarm starts so a bad one fails fast: the snapshot to resume from
    (loaded and verified) and the task class of a new run."""
    plan = task_cls = None
    if opts.spec is not None:
        read_spec_file(opts.spec, opts.run_id)  # a bad file fails before the swarm starts
    if opts.resume_from is not None:
        plan = await asyncio.to_thread(plan_resume, opts.resume_from, run_id=opts.run_id, sets=dict(opts.sets),
                                       key=ensure_identity(opts.swarm.state_dir)[1])
    if opts.task is not None:
        try:
            task_cls = load_task_class(opts.task)
        except TaskError as e:
            raise UsageError(str(e)) from None
    return plan, task_cls


def _left(trainer: Trainer, reason: str, events: Events, keep: Optional[dict]) -> None:
    events.emit("left", reason=reason, step=trainer.state.step, state_hash=trainer.state_hash,
                cursor=trainer.state.cursor.summary(), **trainer.stats)
    if keep is not None:
        keep.update(model=trainer.state.model, step=trainer.state.step, state_hash=trainer.state_hash)


def _left_early(events: Events) -> str:
    """A signal came while the peer was still starting (or bootstrapping): it leaves before training."""
    events.emit("left_early", reason="stopped")  # not `left`: there is no state (step, state_hash) to report
    return "stopped"


def _check_options(opts: JoinOptions) -> None:
    """Refuse a contradictory or incomplete set of options before anything starts (exit 2)."""
    check_run_id(opts.run_id)
    creating, resuming = opts.task is not None or opts.spec is not None, opts.resume_from is not None
    if creating and resuming or opts.task is not None and opts.spec is not None:
        raise UsageError("--task and --spec create a new run and --resume-from restarts one from a snapshot: give one "
                         "of them")
    if not creating and not resuming and not opts.swarm.initial_peers:
        raise UsageError("give --task NAME to create a new run, --resume-from STORE to restart one from a snapshot, "
                         "or --peers MADDR (or SWARMRUN_PEERS) to join one")
    if opts.access not in ("open", "invite"):
        raise UsageError(f"--access must be open or invite, got {opts.access!r}")
    if opts.access != "open" and opts.task is None:
        raise UsageError("--access applies to a new run (with --task); a run keeps the policy it was created with")
    if opts.sets and opts.task is None and not resuming:
        raise UsageError("--set applies to a new run (with --task); an existing run keeps its spec")
    if opts.snapshot is not None:
        opts.snapshot.policy()  # a bad --snapshot-every or --snapshot-keep fails before anything starts


async def _resolve_spec(opts: JoinOptions, dht: DHT, key, plan: Optional["ResumePlan"],
                        task_cls: Optional[type[Task]]) -> tuple[SignedSpec, Task]:
    """The run's signed spec and its task: a new one (``--task``, or ``--spec``: signed by an owner elsewhere), the
    snapshot's (``--resume-from``), or the swarm's (``--peers``).

    Raises:
        UsageError: a new or resumed run that is live at the given peers. RunNotFound: no such run there.
    """
    if opts.task is not None or opts.spec is not None or plan is not None:
        if opts.swarm.initial_peers and await fetch_spec(dht, opts.run_id, timeout=EXISTS_TIMEOUT, anchored_only=True,
                                                         anchors=anchor_ids(opts.swarm.initial_peers)) is not None:
            if opts.task is not None:
                raise UsageError(f"run {opts.run_id!r} already exists at the given peers: join it without --task")
            raise UsageError(f"run {opts.run_id!r} is live at the given peers: join it with --peers, "
                             f"without --resume-from")
        if plan is not None:
            return plan.signed, build_task_for(plan.signed.spec)
        if opts.spec is not None:
            signed = read_spec_file(opts.spec, opts.run_id)
            return signed, build_task_for(signed.spec)
        spec, task = make_spec(run_id=opts.run_id, task_cls=task_cls, sets=opts.sets, seed=opts.seed,
                               owner_key=public_key_bytes(key), access=opts.access)
        return SignedSpec.sign(spec, key.sign), task
    signed = await fetch_spec(dht, opts.run_id, timeout=opts.resolve_timeout,
                              anchors=anchor_ids(opts.swarm.initial_peers))
    if signed is None:
        raise RunNotFound(f"run {opts.run_id!r} was not found at the given peers")
    return signed, build_task_for(signed.spec)


def read_spec_file(path: str, run_id: str) -> SignedSpec:
    """The signed spec in ``path`` (``SignedSpec.encode()``, as a pool's coordinator signs it), verified.

    Raises:
        UsageError: unreadable, or not a spec. IncompatibleState: its signature does not verify, another run.
    """
    try:
        signed = SignedSpec.decode(Path(path).expanduser().read_bytes())
    except OSError as e:
        raise UsageError(f"cannot read spec file {path}: {e.strerror}") from None
    except ProtocolError as e:
        raise UsageError(f"{path} is not a signed spec ({e})") from None
    signed.verify(verify_signature)
    if signed.spec.run_id != run_id:
        raise IncompatibleState(f"the spec in {path} is of run {signed.spec.run_id!r}, not {run_id!r}")
    return signed


async def _admit_self(spec, dht: DHT, key, peer_id: str, credentials: Optional[bytes]) -> AccessGate:
    """The peer's access gate; in an invite-only run, its own admission is checked first (exit 4 with the reason)."""
    gate = AccessGate(spec, credentials=credentials)
    if spec.access != "open":
        if spec.owner_key == public_key_bytes(key) and credentials is None:
            # the owner admits itself: it signs its own certificate
            gate.credentials = Certificate.issue(run_id=spec.run_id, peer_id=peer_id, now=time.time(), ttl=MAX_TTL,
                                                 signer=key.sign).encode()
        await gate.refresh(dht)
        gate.check_self(peer_id)
    return gate


def _snapshot_side(opts: JoinOptions, trainer: Trainer, signed: SignedSpec, plan, events: Events) -> SnapshotSide:
    history = plan.history if plan is not None else ()
    writer = None
    if opts.snapshot is not None:
        writer = SnapshotWriter(trainer, options=opts.snapshot, signed=signed, history=history, events=events)
    return SnapshotSide(trainer=trainer, signed=signed, history=history, events=events, writer=writer,
                        subkey=trainer.subkey,
                        started_step=trainer.state.step,
                        fallback_store=str(opts.swarm.state_dir / "snapshots" / signed.spec.run_id))


async def _bootstrap(opts: JoinOptions, trainer: Trainer, plan, events: Events) -> None:
    """A resumed peer says where it resumed from; a joiner catches up with the swarm's newest state."""
    state = trainer.state
    if plan is not None:
        events.emit("resumed", step=state.step, state_hash=trainer.state_hash, where=plan.snapshot.where,
                    manifest_hash=plan.snapshot.frozen.manifest.manifest_hash(),
                    cursor=state.cursor.summary(), amended=plan.changes)
    if opts.task is not None or opts.spec is not None or plan is not None:
        trainer.served.anchor_here()  # a new or resumed run's history starts with this state
        return
    trainer.reporter.newcomer = True  # others hold this run: it watches a report TTL before it may step alone
    view = await read_view(trainer.dht, trainer.spec.run_id, trainer.gate)
    if view.reports or await read_providers(trainer.dht, trainer.spec.run_id, trainer.gate):
        t0 = time.perf_counter()
        how = await trainer.catchup.catch_up(deadline=time.monotonic() + opts.trainer.state_timeout)
        events.emit("bootstrapped", step=state.step, state_hash=trainer.state_hash,
                    seconds=round(time.perf_counter() - t0, 3), **how)


KEEPER_HANDOFF = 8.0  # a stopped trainer serves a keeper behind its step this long at most (within LEAVE_GRACE)
LEAVE_GRACE = 30.0  # seconds a peer asked to leave may take before it is made to
LEAVE_SLOW = 20.0  # a leave still going after this long writes every thread's stack to stderr (where it hangs); a
# healthy one takes its last report (5 s), a leave snapshot and a hand-off to a keeper behind (KEEPER_HANDOFF) first
KILL_TIMEOUT = 2.0  # a forced leave SIGKILLs its children this long after their SIGTERM


class LeaveSignals:
    """SIGINT/SIGTERM: leave gracefully (finish or abandon the round, last report, shutdown). A second signal, or a
    leave that takes longer than ``LEAVE_GRACE`` (a hivemind child killed by a signal to the whole group can
    leave a call hanging), ends the process and its children at once; the run's committed state lives on with
    the other peers and in snapshots.

    A Python-level handler, not ``loop.add_signal_handler``: it runs even when the loop is blocked. Processes
    forked after ``install`` (hivemind's DHT and averager) inherit it: there it ignores the signal while the host
    lives (the host shuts them down as it leaves) and falls back to the default action in an orphan.
    ``restore`` puts back what was there before (a library caller's own handlers)."""

    def __init__(self, stop: asyncio.Event):
        self.stop, self.count, self.pid = stop, 0, os.getpid()
        self.loop = asyncio.get_running_loop()
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def install(self) -> None:
        for sig in self.previous:
            signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        if os.getpid() == self.pid:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self.pid:  # a forked hivemind child (DHT, averager)
            if os.getppid() == self.pid:
                # the host is leaving and shuts this process down itself. Dying here, on a signal to the whole
                # group (Ctrl-C in a terminal), left the host's leave hanging: an averager killed inside a round
                # holds the averaged tensors' lock, a dead DHT's futures never resolve (the vote, the last report)
                return
            signal.signal(signum, signal.SIG_DFL)  # an orphan: die as it would have
            os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.count > 1:
            _leave_now("a second signal")
        threading.Thread(target=_watchdog, daemon=True, name="leave-watchdog").start()
        self.loop.call_soon_threadsafe(self.stop.set)


def _watchdog() -> None:
    time.sleep(LEAVE_SLOW)
    logger.warning(f"still leaving after {LEAVE_SLOW:.0f}s; the threads' stacks follow")
    faulthandler.dump_traceback(all_threads=True)
    time.sleep(LEAVE_GRACE - LEAVE_SLOW)
    _leave_now(f"a leave that took over {LEAVE_GRACE:.0f}s")


def _leave_now(why: str) -> None:
    logger.warning(f"leaving at once after {why}")
    try:
        kill_descendants(timeout=KILL_TIMEOUT)
    finally:
        os._exit(0)
