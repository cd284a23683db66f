"""The trainer: accumulate per-sample gradients on unapplied blocks, run rounds, commit steps, re-sync.

One asyncio loop; gradients are computed in a worker thread, steps applied on the step thread (``stepper``).
hivemind's DHT and averager run in their own processes, reached through their public API (MPFutures are awaited).
Made of objects of their own: the round and its vote (``rounds.RoundRunner``), the progress reporter and the swarm
view (``reporter.Reporter``), the served state (``served.ServedState``), the catch-up (``catchup.CatchUp``), the
local work of the run's mode (``work``: accumulated gradients, or outer mode's inner steps). The trainer keeps the
loop and applying a committed step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Optional

import torch
from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.swarm import record_validator, signed_subkey
from swarmrun.node.output import Events
from swarmrun.node.peer.access import AccessGate
from swarmrun.node.peer.catchup import CatchUp
from swarmrun.node.peer.config import TrainerConfig
from swarmrun.node.peer.reporter import Reporter
from swarmrun.node.peer.rounds import RoundResult, RoundRunner, SwarmMovedOn, make_averager
from swarmrun.node.peer.served import ServedState
from swarmrun.node.peer.stepper import StepThread, optimizer_step
from swarmrun.node.peer.work import Ahead, make_work, mean_norm
from swarmrun.node.state.run import FrozenState, RunState
from swarmrun.node.state.steps import make_step_record
from swarmrun.node.tasks.base import Task
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.errors import CatchUpFailed, IncompatibleState, RoundsFailed, Stopped, SwarmrunError
from swarmrun.protocol.manifest import DEFAULT_CHUNK_SIZE
from swarmrun.protocol.plan import (Speed, my_quota, pick_blocks, plan_step, ready_for_round, round_eta, run_eta,
                                    shortfall_taker)
from swarmrun.protocol.round import (Claims, Commit, ProgressReport, Role, RoundMeta, SwarmView, decide_claims,
                                     step_target)
from swarmrun.protocol.spec import Spec

logger = logging.getLogger("swarmrun.trainer")
LAST_REPORT_TIMEOUT = 5.0  # the last report on the way out (the DHT may be leaving too)


class Trainer:
    """A peer of a run: trains (or keeps state), averages, commits, serves its state.

    Args:
        spec: the run's verified spec.
        task: the task built from it.
        dht: this peer's running DHT.
        events: where events go.
        state: the run state to start from (step 0 for a new run, or a downloaded one).
    """

    def __init__(self, *, spec: Spec, task: Task, dht: DHT, state: RunState, events: Events, config: TrainerConfig,
                 identity: RSAPrivateKey, gate: Optional[AccessGate] = None, stop_requested: Optional[asyncio.Event] = None):
        self.spec, self.task, self.dht, self.state, self.events, self.config = spec, task, dht, state, events, config
        self.gate = gate if gate is not None else AccessGate(spec)
        self.peer_id = dht.peer_id.to_base58()
        # this peer's DHT records (progress, votes, provider records) are signed with its identity: no one writes for it
        self.subkey = subkey = signed_subkey(record_validator(identity), self.peer_id)
        self.device = torch.device(config.device)
        self.params = [p for p in state.model.parameters()]
        self.work = make_work(spec=spec, task=task, state=state, device=self.device, config=config)
        self.samples = 0  # samples accumulated toward the next step
        self.claims = Claims()  # blocks whose gradients are in the accumulator
        self.ahead: Optional[Ahead] = None  # of those, the next step's, computed while a round communicates
        self.quota: Optional[int] = None  # samples this peer brings to the next step (its part of the plan, published)
        # when this peer last found no free block for the next step (monotonic; 0: not): for a while its part ends
        # with what it has, then it looks again (a dead peer's leases expire, the view changes)
        self.spent_at = 0.0
        self.ready_at = 0.0  # DHT time this peer's part of the next step was computed (0: not yet)
        self.floor = 0  # a round fell short and this peer takes the rest: its part is at least this
        self._looking: Optional[asyncio.Future] = None  # the publish-and-read after the last commit
        self._plan_step, self._step_since = -1, 0.0  # the step plans are for, and when this peer reached it
        self._agreed: tuple[str, dict[str, float]] = ("", {})  # (state_hash, the speeds its committing round gathered)
        self._applying = self._met_min_peers = False  # _applying: mid-apply the accumulator is the last step's
        # set by a signal (even one that came before the trainer existed), a pause, or the library's caller
        self.stop_requested = stop_requested if stop_requested is not None else asyncio.Event()
        self.finished, self.speed = False, Speed()  # speed: this peer's samples/s (plan.Speed)
        self.snapshots = False  # this peer has a snapshot store (set by its SnapshotSide; reported to the others)
        self.compute_seconds = 0.0  # wall time in the task's forward/backward since the last step event (its compute_s)
        self.step_seconds: Optional[float] = None  # mean wall time of a committed step (EMA), for the ETA
        self._last_commit: Optional[tuple[float, int]] = None  # (when, step) of the last commit
        self.last_loss: Optional[float] = None
        self.failed_rounds, self.holding = 0, 0.0  # holding: since when a pause holds this peer (it only catches up)
        self.stats = dict(steps_committed=0, rounds_abandoned=0, resyncs=0, steps_discarded=0)
        self.commit_hooks: list = []  # hook(frozen) after every committed step, in this loop; must not block
        self.stepper = StepThread()  # every optimizer step of this peer, commit or replay (``stepper``: why)
        self.served = ServedState(state=state, spec=spec, dht=dht, gate=self.gate,
                                  chunk_size=int(spec.hparams.get("chunk_size", DEFAULT_CHUNK_SIZE)),
                                  chunk_timeout=config.next_chunk_timeout * 5)
        self.reporter = Reporter(dht=dht, spec=spec, gate=self.gate, config=config, peer_id=self.peer_id,
                                 subkey=subkey, report=self._report,
                                 provider_record=lambda: self.served.provider_record(config.role),
                                 on_tick=self._on_tick, step_seconds=lambda: self.step_seconds)
        self.averager = make_averager(self.params, dht, spec=spec, gate=self.gate, config=config)
        self.rounds = RoundRunner(averager=self.averager, dht=dht, spec=spec, gate=self.gate, config=config,
                                  subkey=subkey, live=self.reporter.recently_live, members=self.reporter.members,
                                  moved_on=lambda: self.catchup.behind(), stop_requested=self.stop_requested,
                                  alone=self._alone)
        self.catchup = CatchUp(dht=dht, spec=spec, config=config, events=events, peer_id=self.peer_id, state=state,
                               served=self.served, reporter=self.reporter, stop_requested=self.stop_requested,
                               replay=lambda *step: self.stepper.run(self._optimizer_step, *step),
                               record_bytes=sum(p.numel() * p.element_size() for p in self.params))

    @property
    def view(self) -> SwarmView:
        return self.reporter.view

    @property
    def frozen(self) -> Optional[FrozenState]:
        """The state of the current step, frozen (served, snapshotted)."""
        return self.served.frozen

    @property
    def state_hash(self) -> str:
        return self.served.state_hash

    async def resync(self) -> None:
        """Catch up with the swarm (drops local accumulation: it belongs to a step this peer is no longer at)."""
        before = self.state.step
        t0 = time.perf_counter()
        how = await self.catchup.catch_up(deadline=time.monotonic() + self.config.state_timeout)
        self._zero_accumulator()
        self.stats["resyncs"] += 1
        self.stats["steps_discarded"] += how["discarded"]  # a split's minority re-synced to the majority's history
        self.events.emit("resync", from_step=before, step=self.state.step, state_hash=self.state_hash,
                         seconds=round(time.perf_counter() - t0, 3), **how)

    # ---- the main loop ------------------------------------------------------------------------------
    async def run(self) -> str:
        """Train until the run finishes, ``max_steps`` is reached or a stop is requested.

        Returns:
            why it ended: "finished", "max_steps" or "stopped".
        """
        await self.served.start()
        reporter = asyncio.create_task(self.reporter.forever())
        try:
            await self.reporter.refresh()
            while True:
                try:
                    reason = await self._iterate()
                except Exception:
                    # a SIGTERM to the whole process group reaches hivemind's children too: what fails while
                    # leaving is part of leaving (the committed state is safe with the others)
                    if self.stop_requested.is_set():
                        return "stopped"
                    raise
                if reason is not None:
                    return reason
        finally:
            reporter.cancel()
            if self.dht.is_alive():
                try:  # the last word: finished or where we stopped (bounded: the DHT may be on its way out)
                    await asyncio.wait_for(self.reporter.publish(), LAST_REPORT_TIMEOUT)
                except asyncio.TimeoutError:
                    pass

    async def _iterate(self) -> Optional[str]:
        """One turn of the main loop; why the peer leaves, or None to go on."""
        if not (self.dht.is_alive() and self.averager.is_alive()):
            await asyncio.sleep(0.5)
            if self.stop_requested.is_set():
                return "stopped"
            raise SwarmrunError("hivemind's DHT or averager process died; leaving")
        if self.spec.finished(self.state.step, self.state.cursor) or self.catchup.finished_elsewhere():
            if not self.spec.finished(self.state.step, self.state.cursor):
                # the others finished while this peer was behind: leave with the run's final state, if a
                # provider still serves it
                try:
                    await self.catchup.catch_up(deadline=time.monotonic() + min(20.0, self.config.state_timeout))
                except (IncompatibleState, CatchUpFailed) as e:
                    logger.warning(f"the run finished; leaving at step {self.state.step}: {e}")
            self.finished = True
            await self.reporter.serve_laggards(self.stop_requested)
            return "finished"
        if self.config.max_steps is not None and self.state.step >= self.config.max_steps:
            return "max_steps"
        if self.stop_requested.is_set():
            return "stopped"
        if self.spec.access != "open":
            self.gate.check_self(self.peer_id)  # revoked or expired: leave with exit code 4 and the reason
        if self.catchup.behind():
            await self.resync()
        elif self.catchup.waiting():  # for the step it asked to be planned in: the swarm's next commits come first
            await asyncio.sleep(self.config.report_interval / 4)
            await self.reporter.refresh()
        elif self.config.role == Role.KEEPER or self.holding:  # a paused peer computes nothing more: it catches up
            await asyncio.sleep(self.config.report_interval)
        elif not self._peers_met():
            if self.samples < self.spec.target_batch_size:
                await self._compute_once(self.spec.target_batch_size)
            else:
                await asyncio.sleep(self.config.report_interval)
        else:
            quota = self.quota = self._my_quota()
            if ready_for_round(self.view, me=self.peer_id, step=self.state.step, samples=self.samples, quota=quota,
                               target=self._target()):
                await self.run_round()
            elif self.samples >= quota:
                await asyncio.sleep(0.05)  # nothing to bring: the others' parts make the step
            else:
                await self._compute_once(quota)
        return None

    def _peers_met(self) -> bool:
        """The ``min_peers`` gate: all of them before the first step; after that, at least one other trainer."""
        live = len(self.view.trainers)
        self._met_min_peers = self._met_min_peers or live >= self.config.min_peers
        alone_ok = live >= 2 or not self.reporter.vanished(self.config.alone_after)  # vanished records are no evidence
        met = live >= self.config.min_peers or (self._met_min_peers and live >= 2)
        return met and alone_ok and not self.holding and not self.reporter.watching()

    def _alone(self) -> bool:
        """``Reporter.alone``: no other trainer live lately (askers for a later step aside); not a newcomer watching."""
        return self.reporter.alone()

    def _my_quota(self) -> int:
        """This peer's part (``protocol.plan``): the whole step when alone; what it has once no free block is left."""
        if self.spent_at and time.monotonic() - self.spent_at < 2 * self.config.report_interval:
            return self.samples
        quota = self._target() if self._alone() else my_quota(self._plan(), self.view, me=self.peer_id,
                                                              step=self.state.step, samples=self.samples)
        return max(quota, self.floor)

    def _plan(self):
        if self._plan_step != self.state.step:  # the DHT time this peer reached its step (commit, re-sync, start)
            self._plan_step, self._step_since = self.state.step, get_dht_time()
        committed, agreed = self._agreed  # by state: a re-sync, even to the same step, leaves that round behind
        return plan_step(self.view, me=self.peer_id, step=self.state.step, my_rate=self.speed.value,
                         target=self._target(), block_size=self.state.cursor.block_size, since=self._step_since,
                         agreed=agreed if committed == self.state_hash else {})

    def _target(self) -> int:
        return step_target(self.state.cursor, self.spec.target_batch_size)

    # ---- gradients -----------------------------------------------------------------------------------
    def _take_blocks(self, quota: int, have: int) -> list[int]:
        """The next blocks: a batch, or what is left of a part (``have`` of ``quota``); none leased or claimed."""
        cursor, step, trainers = self.state.cursor, self.state.step, self.view.trainers
        count = max(1, math.ceil(min(self.work.batch(quota), quota - have) / cursor.block_size))
        leased = self.view.leased(me=self.peer_id, step=step, data_epoch=cursor.data_epoch)
        held = self.claims.blocks.add(leased).add(self.rounds.held_elsewhere(cursor, step, trainers))
        members = sorted(set(trainers) | {self.peer_id})
        return pick_blocks(cursor, count, member=members.index(self.peer_id), members=len(members), exclude=held)

    async def _compute_once(self, quota: int) -> None:
        if self.work.stale(self.state_hash):
            self._zero_accumulator()
        blocks = self._take_blocks(quota, self.samples if self.ahead is None else self.ahead.samples)
        if not blocks:  # every free block of the epoch is applied, held by us or leased: our part is what we hold
            self.spent_at = time.monotonic()
            await asyncio.sleep(self.config.report_interval)
            return
        t0 = time.perf_counter()
        loss, n = await asyncio.to_thread(self.work.compute, blocks)
        dt = time.perf_counter() - t0
        self.compute_seconds += dt
        self.samples += n
        self.claims.add(blocks)
        if self.ahead is not None:
            self.ahead.add(blocks, n)
        self.last_loss = loss
        self.speed.add(n, max(dt, 1e-6))

    def _zero_accumulator(self, applied: Optional[RangeSet] = None) -> None:
        """Drop the local work; after a commit of ``applied``, keep the work computed ahead if ``Ahead.carries`` it."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and applied is not None and ahead.carries(applied, self.state.cursor.data_epoch):
            self.work.carry(self.state_hash)
            self.samples, self.claims = ahead.samples, ahead.claims
        else:
            self.work.reset(self.state_hash)
            self.samples, self.claims = 0, Claims()
        self.speed.close()
        self.spent_at, self.ready_at, self.quota, self.floor = 0.0, 0.0, None, 0

    # ---- the round -----------------------------------------------------------------------------------
    def _meta(self, update: Optional[tuple[list, int]] = None) -> RoundMeta:
        return RoundMeta(spec_hash=self.spec.spec_hash(), step=self.state.step, samples=self.samples,
                         blocks=self.claims.blocks, data_epoch=self.state.cursor.data_epoch,
                         grad_norm=mean_norm(update or self.work.update(self.samples)),
                         certificate=self.gate.credentials or b"", ready_at=self.ready_at,
                         rate=self.speed.value)

    async def run_round(self) -> None:
        """One attempt at the next step. Commits, or abandons and keeps the accumulated gradients (unless the round
        refused or left out its claim: those blocks are computed again)."""
        self.ready_at = self.ready_at or get_dht_time()  # when this peer's part was computed (the first attempt)
        if self._alone() and self.samples >= self._target():
            await self._commit_alone()
            return
        update = self.work.update(self.samples)
        meta = self._meta(update)
        if meta.grad_norm < 0:
            logger.warning("local gradient is not finite: dropping it and skipping this round")
            self._zero_accumulator()
            return
        meta = self.rounds.load(*update, meta=meta)  # with error feedback, its declared norm is of what it now sends
        plan = self._plan()
        try:
            result = await self._attempt(meta, plan)
        except Stopped:
            raise
        except Exception as e:  # left out by a fast swarm: ask to be planned a step ahead (published below)
            moved = isinstance(e, SwarmMovedOn) and e.passed  # (not: the others vanished)
            asks = {"asks_for": self.catchup.left_out()} if moved else {}
            self._abandon(f"no round formed: {type(e).__name__}: {e}", **asks)
            await self.reporter.publish_and_read()
            return
        claims, outcome = result.claims, result.outcome
        if isinstance(result.decision, Commit):
            ready = max([m.ready_at for m in outcome.metas if m.ready_at] or [self.ready_at])
            mine = self.work.fields()
            t_apply = time.perf_counter()
            await self.stepper.run(self._apply_step, claims.applied, True, result.decision.majority)
            self._agreed = (self.state_hash, {p: m.rate for p, m in zip(outcome.peer_ids, outcome.metas)})
            self._after_commit()
            # where the round's overhead went: the group forming after the last part was computed, the all-reduce,
            # the vote, applying the step (round_overhead_s is all of it, from the last part to this event)
            parts = dict(group_wait_s=round(max(0.0, outcome.formed_at - ready), 3) if outcome.formed_at else None,
                         allreduce_s=round(outcome.allreduce_s, 3), apply_s=round(time.perf_counter() - t_apply, 3))
            self.events.emit("step", **self._step_fields(group=len(outcome.peer_ids), round_s=result.seconds,
                                                          vote_s=round(result.vote_seconds, 3), samples=claims.samples,
                                                          **parts, blocks=claims.applied.to_list(),
                                                          round_overhead_s=round(max(0.0, get_dht_time() - ready), 3),
                                                          sent_bytes=outcome.sent_bytes,
                                                          compute_s=self._compute_taken(), **mine))
            # in the background: the next step's first batch may plan on the older view, the next ones read this one
            self._looking = asyncio.ensure_future(self.reporter.publish_and_read())
            if self.samples:  # work carried from the round (outer_overlap): the rest of the part on a fresh view
                await self.reporter.await_step(outcome.peer_ids, self.state.step)
        else:
            me = outcome.peer_ids.index(self.peer_id) if self.peer_id in outcome.peer_ids else -1
            if me in claims.refused:
                logger.warning("my claimed blocks overlapped another participant's: dropping my accumulated gradients")
                self._zero_accumulator()
            short = self._target() - claims.samples
            taker = me >= 0 and me not in claims.refused and short > 0 and shortfall_taker(list(outcome.peer_ids),
                                                                                           me=self.peer_id)
            self._abandon(result.decision.reason, round=outcome.group_id.hex()[:12], quota=self.quota,
                          parts=[m.samples for m in outcome.metas], group=[p[-6:] for p in outcome.peer_ids],
                          takes_rest=short if taker else 0)
            if taker:
                self.floor = self.samples + short  # the round fell short: this peer computes the rest

    async def _attempt(self, meta: RoundMeta, plan) -> RoundResult:
        """The round; with ``outer_overlap`` the next step's inner steps run meanwhile (``Ahead``, ``InnerSteps.carry``)."""
        attempt = self.rounds.start(
            meta, cursor=self.state.cursor, target=self._target(), tolerance=self.spec.step_tolerance,
            group_size=len(plan.quotas), eta=round_eta(plan, self.view, me=self.peer_id, step=self.state.step))
        if not self.spec.outer_overlap or self.work.stale(self.state_hash):  # (stale: no part of its own to go on from)
            return await attempt
        self.work.hold()
        part = min(self.samples, plan.quotas.get(self.peer_id, self.samples))  # this part, as the plan has it
        self.ahead = ahead = Ahead(part, self.state.cursor.data_epoch, before=(self.samples, self.claims.copy()))
        try:  # from when the group formed: members still computing their parts may share this peer's cores
            await self.rounds.until_formed(attempt)
            while not attempt.done() and self.ahead is ahead:
                if ahead.samples < ahead.part:
                    await self._compute_once(ahead.part)
                else:
                    await asyncio.wait([attempt], timeout=self.config.report_interval)
        except Exception as e:  # the work ahead is dropped; the round goes on (a commit is applied)
            logger.warning(f"computing ahead of the round failed: {type(e).__name__}: {e}; dropped")
            self._drop_ahead()
        except BaseException:  # (leaving) the round's buffers are not loaded again: nothing waits for its end
            attempt.cancel()
            raise
        return await attempt

    def _drop_ahead(self) -> None:
        if self.ahead is not None:  # the round's part is kept, what was computed ahead is dropped
            self.work.release()
            (self.samples, self.claims), self.ahead = self.ahead.before, None

    def _abandon(self, reason: str, **why) -> None:
        """``why``: what the round was made of, for the event (each member's samples, this peer's part)."""
        self._drop_ahead()
        self.spent_at, self.ready_at = 0.0, 0.0  # the part is planned again (the swarm may have changed)
        self.stats["rounds_abandoned"] += 1
        self.failed_rounds += 1
        logger.warning(f"round abandoned: {reason}")
        self.events.emit("round_abandoned", step=self.state.step, reason=reason, **why)
        if self.failed_rounds > self.config.max_failed_rounds:
            raise RoundsFailed(f"{self.failed_rounds} rounds in a row were abandoned; last: {reason}")

    async def _commit_alone(self) -> None:
        """The only live trainer commits its own gradient: a group of one is the whole run."""
        claims = decide_claims([self._meta()], self.state.cursor)
        if claims.refused:
            self._zero_accumulator()
            return
        ready = self.ready_at or get_dht_time()
        mine = self.work.fields()
        # with vanished trainers remembered (crashed or cut off: the same from inside) a minority commit (no anchor)
        await self.stepper.run(self._apply_step, claims.applied, False, self.reporter.members() <= 1)
        self._after_commit()
        self.events.emit("step", **self._step_fields(group=1, round_s=0.0, samples=claims.samples,
                                                      blocks=claims.applied.to_list(),
                                                      round_overhead_s=round(max(0.0, get_dht_time() - ready), 3),
                                                      compute_s=self._compute_taken(), **mine))

    def _apply_step(self, applied: RangeSet, from_buffers: bool, majority: bool) -> None:
        """The committed step: the optimizer on the (identical) averaged gradient, then cursor and step advance.
        ``majority``: the round held a majority of the run's membership (the step becomes the history's anchor)."""
        if from_buffers:
            with self.averager.get_tensors() as buffers:
                grads = [buf.to(p.device, dtype=p.dtype, copy=True) for p, buf in zip(self.params, buffers)]
        else:
            tensors, divisor = self.work.update(self.samples)
            grads = [None if g is None else g.div_(max(1, divisor)) for g in tensors]
        before, self._applying, self.served.next_anchor = self.state_hash, True, "here" if majority else None
        self._optimizer_step(grads, applied)
        self._zero_accumulator(applied)
        self._applying = False
        self.failed_rounds = 0
        self.stats["steps_committed"] += 1
        self.served.record = make_step_record(spec_hash=self.spec.spec_hash(), step=self.state.step - 1, grads=grads,
                                        applied=applied, data_epoch=self.state.cursor.data_epoch,
                                        state_hash_before=before, state_hash_after=self.state_hash,
                                        chunk_size=self.served.chunk_size, anchor=self.served.anchor)
        every = int(self.spec.hparams.get("eval_every", 0))
        if every and self.state.step % every == 0 or self.spec.finished(self.state.step, self.state.cursor):
            loss = self.task.evaluate(self.state.model, self.device)
            self.events.emit("eval", step=self.state.step, loss=loss)

    def _optimizer_step(self, grads: list[Optional[torch.Tensor]], applied: RangeSet) -> None:
        """Step ``step -> step + 1`` with these gradients (``stepper.optimizer_step``), and serve the new state."""
        clip = float(self.spec.hparams.get("clip_norm", 0.0)) if self.work.clips_commit else 0.0
        optimizer_step(self.state, self.params, grads, applied, clip=clip)
        self.served.refresh()

    def _after_commit(self) -> None:
        now = time.monotonic()
        if self._last_commit is not None:  # wall time a step takes, rounds included (what an ETA must count)
            at, step = self._last_commit
            dt = (now - at) / max(1, self.state.step - step)  # a re-sync in between advanced several steps
            self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt
        self._last_commit = (now, self.state.step)
        self.catchup.trained()  # it committed: its asks to be planned ahead (if it was left out before) start over
        self.served.publish()
        for hook in list(self.commit_hooks):
            try:
                hook(self.frozen)
            except Exception as e:  # a hook (snapshot writer, ...) must not take the trainer down
                logger.warning(f"commit hook {getattr(hook, '__name__', hook)!r} failed: {type(e).__name__}: {e}")

    def _compute_taken(self) -> float:
        """The step event's ``compute_s``: forward and backward seconds since the last step event (dropped work too)."""
        taken, self.compute_seconds = self.compute_seconds, 0.0
        return round(taken, 3)

    def _step_fields(self, **extra) -> dict:
        trainers = self.view.trainers
        sps = sum(r.samples_per_second for p, r in trainers.items() if p != self.peer_id) + self.speed.value
        eta = run_eta(self.spec.steps_left(self.state.step, self.state.cursor), step_seconds=self.step_seconds,
                      target=self.spec.target_batch_size, samples_per_second=sps)
        return dict(step=self.state.step, total_steps=self.spec.total_steps, loss=self.last_loss, eta_s=eta,
                    samples_accumulated=self.samples, state_hash=self.state_hash, samples_per_second=round(sps, 2),
                    peers=max(1, len(trainers)), cursor=self.state.cursor.summary(), **extra)

    # ---- progress reports ----------------------------------------------------------------------------
    def _report(self) -> ProgressReport:
        # a leaving peer releases its blocks in its last report rather than holding them until the report expires; so
        left = self.stop_requested.is_set() or bool(self.holding) or (  # does one a pause holds: no one waits for it
            self.config.max_steps is not None and self.state.step >= self.config.max_steps)
        step, state_hash, anchor = self.served.position  # one object: not the next step with this one's hash
        held = not (self.finished or left or self._applying)  # mid-apply the accumulator is the last step's
        ahead = self.ahead  # (once: the step thread clears it) work ahead is the next step's
        samples = self.samples if ahead is None else ahead.before[0]
        return ProgressReport(step=step, samples=samples if held else 0, role=self.config.role,
                              samples_per_second=self.speed.value, state_hash=state_hash, time=get_dht_time(),
                              finished=self.finished or self.spec.finished(self.state.step, self.state.cursor),
                              certificate=self.gate.credentials or b"", data_epoch=self.state.cursor.data_epoch,
                              claimed=self.claims.lease() if held else RangeSet(),
                              cursor=self.state.cursor.summary(), snapshots=self.snapshots,
                              left=left, quota=self.quota if held else None, joining=self.catchup.joining,
                              anchor=anchor)

    def _on_tick(self) -> None:
        if self.state.step > 0:
            self.events.emit("progress", **self._step_fields())

    def shutdown(self) -> None:
        self.stepper.close()
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"averager shutdown: {e!r}")
