"""A peer's side of snapshots: the elected writer (a commit hook), the pause watcher, and resuming a run.

Training never waits for storage: the commit hook only decides (``decide_snapshot``, a pure function) and hands the
already frozen state of the step (``trainer.frozen``, the copy the trainer makes anyway to serve joiners) to a worker
thread. One write is in flight at a time; a step that comes while one is, waits for the next decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from hivemind.utils.timed_storage import get_dht_time

from swarmrun.protocol.codec import pack
from swarmrun.protocol.errors import AccessRefused, IncompatibleState, ProtocolError, SwarmrunError, UsageError
from swarmrun.protocol.snapshot import (Amendment, FailureWatch, PauseNote, PauseRecord, PauseTurn, SnapshotPolicy,
                                        amend_changes, decide_pause_turn, decide_snapshot, elect_writer, history_key,
                                        parse_every, pause_key, paused_key, trainer_notes, writer_candidates)
from swarmrun.protocol.spec import SignedSpec, Spec, amend
from swarmrun.node.state.store import Snapshot, SnapshotStore, WriteResult, open_ref
from swarmrun.node.state.run import FrozenState, RunState
from swarmrun.node.net.swarm import public_key_bytes, verify_signature
from swarmrun.node.net.records import HISTORY_TTL, NOTE_TTL, owner_subkey, read_history, store_record

logger = logging.getLogger("swarmrun.snapshot")
PAUSE_TAKEOVER = 30.0  # seconds a paused peer waits for each writer ahead of it before it writes the snapshot itself
HISTORY_TIMEOUT = 5.0  # a joined peer's read of an amended run's history, before it writes a snapshot
FRESH_VIEW_TIMEOUT = 3.0  # a leaving peer's last read of the run's reports (its DHT may be leaving too)
PAUSE_GIVE_UP = 600.0  # a paused peer whose every write failed leaves after this long without any snapshot
PAUSE_CATCH_UP = 20.0  # a peer the swarm is ahead of at the pause step catches up this long at most before it stops
PAUSE_SETTLE = 3.0  # and one at the pause step holds at least this long (or two report intervals) before it stops


@dataclass(frozen=True, kw_only=True)
class SnapshotOptions:
    """``--snapshot-to STORE [--snapshot-every N|Nm|Ns|auto] [--snapshot-keep K]``."""

    store: str
    every: Optional[str] = "auto"
    keep: int = 3

    def policy(self) -> SnapshotPolicy:
        steps, seconds, auto = parse_every(self.every)
        if self.keep < 1:
            raise UsageError("--snapshot-keep must be >= 1")
        return SnapshotPolicy(every_steps=steps, every_seconds=seconds, auto=auto, keep=self.keep)


# ---- resume ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumePlan:
    """What ``--resume-from`` restarts: the verified snapshot, the (possibly amended) signed spec, the history."""

    snapshot: Snapshot
    signed: SignedSpec
    history: tuple[bytes, ...]
    changes: dict


def verified_history(history, spec: Spec) -> tuple[bytes, ...]:
    """Check each amendment is the owner's and the chain ends at ``spec``; the history as given.

    Raises:
        IncompatibleState: a bad signature or a broken chain.
    """
    last = None
    for raw in history:
        try:
            a = Amendment.decode(raw)
        except ProtocolError as e:
            raise IncompatibleState(f"the run's amendment history is malformed: {e}") from None
        a.verify(spec.owner_key, verify_signature)
        if last is not None and a.from_spec != last:
            raise IncompatibleState("the run's amendment history is not a chain")
        last = a.to_spec
    if last is not None and last != spec.spec_hash():
        raise IncompatibleState("the run's amendment history does not end at its spec")
    return tuple(history)


def choose_history(found: Sequence[tuple[bytes, ...]], spec: Spec) -> tuple[bytes, ...]:
    """The amendment history of ``spec`` among those the run's peers publish (each under its signed subkey): the
    longest that verifies (``verified_history``); one that does not is skipped. () when none does.

    Raises:
        IncompatibleState: histories were published and none verifies.
    """
    errors = []
    for history in sorted(found, key=len, reverse=True):
        try:
            return verified_history(history, spec)
        except IncompatibleState as e:
            errors.append(str(e))
    if errors:
        raise IncompatibleState(f"no published amendment history verifies: {errors[0]}")
    return ()


def plan_resume(ref: str, *, run_id: str, sets: dict, key) -> ResumePlan:
    """Load and verify a snapshot to restart a run from; with ``sets``, amend its spec (owner only).

    Raises:
        RunNotFound: no snapshot there. IncompatibleState: corrupt or foreign snapshot. AccessRefused: an
        amendment by a key that is not the run's owner. UsageError: a setting that may not change.
    """
    store, step = open_ref(ref)
    snap = store.load(step)
    try:
        signed = SignedSpec.decode(snap.record.signed_spec)
    except ProtocolError as e:
        raise IncompatibleState(f"snapshot {snap.where} holds no valid spec: {e}") from None
    signed.verify(verify_signature)
    spec = signed.spec
    if spec.spec_hash() != snap.frozen.manifest.spec_hash:
        raise IncompatibleState(f"snapshot {snap.where} holds a state of another spec than its own (foreign)")
    if spec.run_id != run_id:
        raise IncompatibleState(f"snapshot {snap.where} is of run {spec.run_id!r}, not {run_id!r}")
    history = verified_history(snap.record.history, spec)
    if not sets:
        return ResumePlan(snap, signed, history, {})
    changes = amend_changes(sets, spec.hparams)
    if public_key_bytes(key) != spec.owner_key:
        raise AccessRefused(f"only the owner of run {run_id!r} may change its settings; this --state-dir holds "
                            f"another key")
    new_spec = amend(spec, **changes)
    record = Amendment(step=snap.frozen.step, from_spec=spec.spec_hash(), to_spec=new_spec.spec_hash(),
                       changes=changes, time=time.time())
    record = replace(record, signature=bytes(key.sign(record.unsigned_bytes())))
    return ResumePlan(snap, SignedSpec.sign(new_spec, key.sign), (*history, record.encode()), changes)


def apply_resume(state: RunState, plan: ResumePlan) -> None:
    """Load the snapshot into ``state`` (built from the plan's spec); an amended lr or schedule takes effect now."""
    new_hash = state.spec_hash
    state.spec_hash = plan.snapshot.frozen.manifest.spec_hash
    state.apply_frozen(plan.snapshot.frozen)
    state.spec_hash = new_hash
    if not plan.changes:
        return
    sched = state.scheduler
    # the groups the schedule drives: the state's optimizer's, or in outer mode the inner optimizer's
    groups = getattr(sched, "optimizer", state.optimizer).param_groups
    if "lr" in plan.changes:
        lr = float(plan.changes["lr"])
        for g in groups:
            g["initial_lr"] = lr
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr for _ in sched.base_lrs]
        for g in groups:
            g["lr"] = lr
    if hasattr(sched, "lr_lambdas"):  # the schedule's functions come from the amended spec (total_steps)
        for g, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in groups]


# ---- the writer --------------------------------------------------------------------------------------------
class SnapshotWriter:
    """Writes snapshots of the run when this peer is the elected writer and the policy says so (a commit hook)."""

    def __init__(self, trainer, *, options: SnapshotOptions, signed: SignedSpec, history: tuple[bytes, ...], events):
        self.trainer, self.options, self.signed, self.history, self.events = trainer, options, signed, history, events
        self.policy = options.policy()
        self.store = SnapshotStore(options.store, keep=self.policy.keep)
        existing = [s for s in self.store.steps()]
        self.last_step: Optional[int] = None  # of the last write attempted (the policy's cadence)
        self.written_step: Optional[int] = None  # of the newest write that succeeded in this writer's store
        self.last_time: Optional[float] = None
        self.cost_s: Optional[float] = None
        self.failures = FailureWatch(started=time.monotonic())
        self.step_s: Optional[float] = None
        self._last_commit: Optional[float] = None
        self._inflight: Optional[asyncio.Task] = None
        self._reported_interval: Optional[float] = None
        self._reported_fixed = False
        if existing:
            logger.info(f"snapshot store {options.store} holds steps {existing}")

    def on_commit(self, frozen: FrozenState) -> None:
        now = time.monotonic()
        if self._last_commit is not None:
            dt = now - self._last_commit
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        self._last_commit = now
        t = self.trainer
        self.failures.update(now, t.view.trainers, t.peer_id)
        stores = {p: r.snapshots for p, r in t.view.trainers.items()}
        elected = elect_writer(writer_candidates(stores, t.peer_id, i_write=True)) == t.peer_id
        d = decide_snapshot(now, step=frozen.step, last_step=self.last_step, last_time=self.last_time,
                            policy=self.policy, cost_s=self.cost_s, failures=self.failures.failures,
                            observed_s=self.failures.observed_s(now), elected=elected)
        self._report_policy(d, elected)
        if d.write and (self._inflight is None or self._inflight.done()):
            self._inflight = asyncio.ensure_future(self._write(frozen, d.reason))

    def _report_policy(self, d, elected: bool) -> None:
        """The ``snapshot_policy`` event, all of them with ``one_write_at_a_time``: a step that commits while a write
        is in flight is not written (the next decision writes the newest step; ``--snapshot-every 1`` on a swarm that
        steps faster than a write writes some steps only). The auto policy's interval and expected replay, whenever
        the interval moves by more than 20%; a fixed policy's cadence (``every_steps`` or ``every_s``) once, when
        this peer is first elected."""
        fixed = dict(every_steps=self.policy.every_steps, every_s=self.policy.every_seconds)
        if d.interval_s is None:
            if elected and not self._reported_fixed and (self.policy.every_steps or self.policy.every_seconds):
                self._reported_fixed = True
                self.events.emit("snapshot_policy", **{k: v for k, v in fixed.items() if v is not None},
                                 one_write_at_a_time=True)
            return
        last = self._reported_interval
        if last is not None and abs(d.interval_s - last) <= 0.2 * last:
            return
        self._reported_interval = d.interval_s
        steps = f" (~{d.replay_s / self.step_s:.1f} steps)" if self.step_s else ""
        logger.info(f"snapshot policy {d.reason}; expected replayed work after a failure ~{d.replay_s:.1f}s{steps}")
        self.events.emit("snapshot_policy", interval_s=round(d.interval_s, 3), cost_s=self.cost_s,
                         failures=self.failures.failures, expected_replay_s=round(d.replay_s, 3),
                         expected_replay_steps=round(d.replay_s / self.step_s, 2) if self.step_s else None,
                         one_write_at_a_time=True)

    async def _write(self, frozen: FrozenState, reason: str, store: Optional[SnapshotStore] = None) -> Optional[WriteResult]:
        store = store or self.store
        self.last_step, self.last_time = frozen.step, time.monotonic()
        history = await self._current_history()
        try:
            result = await asyncio.to_thread(store.write, frozen, signed_spec=self.signed.encode(), history=history,
                                             writer=self.trainer.peer_id)
        except SwarmrunError as e:
            logger.warning(str(e))
            self.events.emit("snapshot_failed", step=frozen.step, message=str(e))
            return None
        if store is self.store:
            self.written_step = max(self.written_step or 0, result.step)  # durable in this writer's own store
        self.cost_s = result.seconds if self.cost_s is None else 0.7 * self.cost_s + 0.3 * result.seconds
        self.events.emit("snapshot", step=result.step, where=result.where, seconds=round(result.seconds, 3),
                         chunks_written=result.chunks_written, chunks_reused=result.chunks_reused,
                         bytes_written=result.bytes_written, dropped=list(result.dropped), reason=reason,
                         state_hash=frozen.manifest.state_hash(), manifest_hash=frozen.manifest.manifest_hash())
        return result

    async def _current_history(self) -> tuple[bytes, ...]:
        if self.history:
            return self.history
        try:  # a peer that joined an amended run learns its history from the peers that resumed it
            found = await asyncio.wait_for(read_history(self.trainer.dht, history_key(self.signed.spec.run_id)),
                                           HISTORY_TIMEOUT)
            self.history = choose_history(found, self.signed.spec)
        except (asyncio.TimeoutError, SwarmrunError, ValueError) as e:
            logger.warning(f"snapshot without the amendment history: {e}")
        return self.history

    async def write_now(self, frozen: FrozenState, reason: str, store: Optional[SnapshotStore] = None) -> Optional[WriteResult]:
        """Write this state now (pause, last peer leaving), after any write in flight."""
        await self.flush()
        if store is None and self.written_step is not None and self.written_step >= frozen.step:
            return WriteResult(step=frozen.step, where=f"{self.store.url}@{frozen.step}", chunks_written=0,
                               chunks_reused=len(frozen.manifest.chunks), bytes_written=0, seconds=0.0, dropped=())
        return await self._write(frozen, reason, store)

    async def flush(self) -> None:
        if self._inflight is not None:
            await asyncio.shield(self._inflight)






# ---- the peer side of pause, history publishing, the last peer's snapshot -------------------------------------
@dataclass
class SnapshotSide:
    """Everything snapshot-related a peer runs next to its trainer; ``close()`` before it leaves."""

    trainer: object
    signed: SignedSpec
    history: tuple[bytes, ...]
    events: object
    writer: Optional[SnapshotWriter] = None
    fallback_store: str = ""  # where a peer without --snapshot-to writes when a pause or its leaving needs it
    subkey: bytes = b""  # this peer's signed subkey (``Trainer.subkey``): its pause notes carry its signature
    started_step: int = 0
    started_time: float = field(default_factory=get_dht_time)
    pause: Optional[PauseRecord] = None
    _tasks: list = field(default_factory=list)  # background loops, cancelled on close

    def start(self) -> None:
        """Call once the peer holds the state it trains from (after a resume or a bootstrap)."""
        t = self.trainer
        # a pause this peer's state is already past (the one a resumed run was paused by) is history
        self.started_step = max(self.started_step, t.state.step)
        self.started_time = get_dht_time()
        if self.writer is not None:
            t.snapshots = True  # its reports say so: only a peer with a store is elected writer
            t.commit_hooks.append(self.writer.on_commit)
        t.commit_hooks.append(self._on_commit)
        self._tasks.append(asyncio.ensure_future(self._watch_pause()))
        if self.history:
            self._tasks.append(asyncio.ensure_future(self._publish_history()))

    async def _publish_history(self) -> None:
        while True:
            try:
                await store_record(self.trainer.dht, history_key(self.signed.spec.run_id), pack(list(self.history)),
                                   HISTORY_TTL, subkey=self.subkey)  # its own signed subkey: no one can replace it
            except Exception as e:
                logger.debug(f"could not publish the amendment history: {e!r}")
            await asyncio.sleep(HISTORY_TTL / 4)

    def _honoured(self, record: PauseRecord) -> bool:
        spec = self.trainer.spec
        if record.run_id != spec.run_id or record.spec_hash != spec.spec_hash():
            return False
        # a pause that this run resumed from (or an earlier one) is history, not a request
        if record.time < self.started_time and record.at_step <= self.started_step:
            return False
        return record.verify(spec.owner_key, verify_signature)

    async def _watch_pause(self) -> None:
        t = self.trainer
        key = pause_key(t.spec.run_id)
        while True:
            if self.pause is None:
                self.pause = await self._read_pause(key)
            # a peer at (or past) the pause step steps no further (``holding``). A round the others had in flight when
            # the pause came may still commit a step without it (CI saw a peer leave a step behind the others, twice:
            # stopping at once and stopping as soon as its view said "not behind", a view a report old): it holds long
            # enough for such a commit to reach its view, catches up to it, and stops
            if self.pause is not None and t.state.step >= self.pause.at_step:
                t.holding = t.holding or time.monotonic()
                held = time.monotonic() - t.holding
                if (held >= self.settle_seconds() and not t.catchup.behind()) or held > PAUSE_CATCH_UP:
                    t.stop_requested.set()
                    return
            await asyncio.sleep(t.config.report_interval)

    async def _read_pause(self, key: str) -> Optional[PauseRecord]:
        from swarmrun.node.runtime import await_future

        try:
            found = await await_future(self.trainer.dht.get(key, latest=True, return_future=True))
            # only the owner's signed subkey: a record anyone else wrote is not the owner's, whatever it says
            item = found.value.get(owner_subkey(self.trainer.spec.owner_key)) \
                if found is not None and isinstance(found.value, dict) else None
            if item is None:
                return None
            record = PauseRecord.decode(item.value)
        except ProtocolError as e:
            logger.warning(f"malformed pause record: {e}")
            return None
        except Exception as e:
            logger.debug(f"could not read the pause record: {e!r}")
            return None
        if not self._honoured(record):
            logger.debug("ignoring a pause record that is not the owner's, or not for this run")
            return None
        logger.info(f"the run's owner paused it at step {record.at_step}")
        return record

    def settle_seconds(self) -> float:
        """How long a peer at the pause step holds before it stops: a round the others form ends (a group waits up to 3
        matchmaking times), its commit is published and read back (a report interval each). At most PAUSE_CATCH_UP/2."""
        t = self.trainer
        rounds = 3 * t.config.matchmaking_time + t.config.report_interval
        return min(max(PAUSE_SETTLE, 2 * t.reporter.interval(), rounds), PAUSE_CATCH_UP / 2)

    def _on_commit(self, frozen: FrozenState) -> None:
        if self.pause is not None and frozen.step >= self.pause.at_step:
            # called before the trainer loop goes on: no further step starts (``_watch_pause`` says when it stops)
            self.trainer.holding = self.trainer.holding or time.monotonic()

    async def _pause_snapshot(self) -> PauseNote:
        """The state this peer stopped at (a round in flight when the pause came may have committed one more
        step, on all its participants alike) is written by the elected writer, or by the next one if it fails;
        this peer says it left only once a durable snapshot of its step exists (``decide_pause_turn``)."""
        t = self.trainer
        frozen = t.frozen
        stores = {p: r.snapshots for p, r in t.view.trainers.items() if not r.finished}
        candidates = writer_candidates(stores, t.peer_id, i_write=self.writer is not None,
                                       pause_store=self.pause.store)
        since = time.monotonic()
        mine: Optional[PauseNote] = None
        while time.monotonic() - since < PAUSE_GIVE_UP:
            notes = await self._read_notes(trainers=set(stores) | {t.peer_id})
            if mine is not None:
                notes[t.peer_id] = mine
            turn = decide_pause_turn(now=time.monotonic(), since=since, me=t.peer_id, candidates=candidates,
                                     trainers=stores, notes=notes, step=frozen.step, takeover_s=PAUSE_TAKEOVER)
            if not t.dht.is_alive() and mine is None:  # no swarm left to ask or to tell: write, then leave
                turn = PauseTurn("write", "this peer's DHT is gone")
            if turn.action in ("leave", "give_up"):
                (logger.info if turn.action == "leave" else logger.error)(f"leaving the paused run: {turn.reason}")
                return PauseNote(step=frozen.step, left=True, error=mine.error if mine is not None else "")
            if turn.action == "write" and mine is None:
                logger.info(f"writing the pause snapshot of step {frozen.step}: {turn.reason}")
                await self._note(PauseNote(step=frozen.step, left=False))  # "writing": the others wait for it
                mine = await self._write_pause(frozen)
                if mine.where:
                    return mine
                await self._note(mine)  # failed: the next writer takes over at once
            await asyncio.sleep(0.5)
        logger.error(f"leaving the paused run after {PAUSE_GIVE_UP:.0f}s without a durable snapshot of step "
                     f"{frozen.step}: every write failed (see above)")
        return PauseNote(step=frozen.step, left=True, error=mine.error if mine else "no snapshot could be written")

    async def _read_notes(self, *, trainers: set) -> dict:
        """The pause notes that count: the trainers' own, signed (a stranger's "written to" is nobody's word)."""
        from swarmrun.node.net.records import read_subkeys

        t = self.trainer
        if not t.dht.is_alive():
            return {}
        try:
            found = await asyncio.wait_for(read_subkeys(t.dht, paused_key(t.spec.run_id), PauseNote.decode,
                                                        signed=True), FRESH_VIEW_TIMEOUT)
            return trainer_notes(found, trainers=trainers)
        except Exception as e:
            logger.debug(f"could not read the pause notes: {e!r}")
            return {}

    async def _write_pause(self, frozen: FrozenState) -> PauseNote:
        """Write to the pause's store, else this peer's own, else its fallback store in its state dir."""
        urls = [u for u in (self.pause.store, self.writer.options.store if self.writer else "", self.fallback_store)
                if u]
        for url in dict.fromkeys(urls):
            result = await self.write_to(frozen, "pause", url)
            if result is not None:
                return PauseNote(step=frozen.step, left=True, where=result.where,
                                 state_hash=frozen.manifest.state_hash(), manifest_hash=frozen.manifest.manifest_hash())
        return PauseNote(step=frozen.step, left=False, error="the snapshot could not be written (see the peer's log)")

    async def write_to(self, frozen: FrozenState, reason: str, url: str) -> Optional[WriteResult]:
        """Write ``frozen`` to the store at ``url`` now (through this peer's writer when it has one)."""
        try:
            if self.writer is not None:
                store = None if url == self.writer.options.store else SnapshotStore(url, keep=self.writer.policy.keep)
                return await self.writer.write_now(frozen, reason, store)
            writer = SnapshotWriter(self.trainer, options=SnapshotOptions(store=url), signed=self.signed,
                                    history=self.history, events=self.events)
            return await writer.write_now(frozen, reason)
        except SwarmrunError as e:
            logger.warning(f"could not write a snapshot to {url}: {e}")
            return None

    async def _note(self, note: PauseNote) -> None:
        try:
            await store_record(self.trainer.dht, paused_key(self.trainer.spec.run_id), note.encode(), NOTE_TTL,
                               subkey=self.subkey)
        except Exception as e:
            logger.warning(f"could not publish the pause note: {e!r}")

    async def _fresh_view(self):
        """The run's reports now (peers that left just before this one say so in their last report)."""
        from swarmrun.node.net.records import read_view

        if not self.trainer.dht.is_alive():  # a signal to the whole group ends hivemind's processes too
            return self.trainer.view
        try:
            return await asyncio.wait_for(read_view(self.trainer.dht, self.trainer.spec.run_id, self.trainer.gate),
                                          FRESH_VIEW_TIMEOUT)
        except Exception as e:
            logger.debug(f"could not read the run's reports: {e!r}")
            return self.trainer.view

    async def close(self, reason: str) -> None:
        """Before leaving: finish the write in flight. A paused peer leaves once a snapshot of the state it stopped
        at is durable (``_pause_snapshot``) and says so (one note per peer). Otherwise a trainer that has a store
        writes its state (chunks already in the store are reused), and the last trainer of all, when none has one, writes it to its state
        dir (``fallback_store``): a leave never takes the run's committed steps with it."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        t = self.trainer
        if self.writer is not None:
            await self.writer.flush()
        if self.pause is not None and t.frozen is not None and t.frozen.step >= self.pause.at_step:
            await self._note(await self._pause_snapshot())
            return
        if reason not in ("stopped", "max_steps") or t.frozen is None or (self.writer is None and not self.fallback_store):
            return
        others = {p: r for p, r in (await self._fresh_view()).trainers.items()
                  if p != t.peer_id and not r.finished and not r.left}
        # a peer with a store always writes its state on the way out: the others with a store may be leaving in the
        # same second (a pool hands back two workstations of a run at once), each seeing the other still there; the
        # churn harness's pool trace lost 11 committed steps that way when only the last one wrote
        if self.writer is not None:
            if others and not any(r.snapshots for r in others.values()):
                logger.warning(f"the last peer with a snapshot store leaves; {len(others)} peer(s) train on "
                               f"without snapshots")
            await self.writer.write_now(t.frozen, "peer with a store leaving")
            return
        if any(r.snapshots for r in others.values()):
            return
        elif not others and self.fallback_store:
            result = await self.write_to(t.frozen, "last peer of the run leaving", self.fallback_store)
            if result is not None:
                logger.warning(f"the last peer of the run had no --snapshot-to: its state is in its state dir; "
                               f"resume with --resume-from {result.where}")
