"""The trainer: accumulate per-sample gradients on unapplied blocks, run rounds, commit steps, re-sync.

One asyncio loop; the gradient computation and the optimizer step run in a worker thread. hivemind's DHT
and averager run in their own processes and are reached through their public API (MPFutures are awaited).
The catch-up (step-record replay and state fetch) is a mixin in ``catchup.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from ..protocol.cursor import RangeSet
from ..protocol.errors import IncompatibleState, ProtocolError, SwarmrunError
from ..protocol.round import (
    Commit,
    ProgressReport,
    Role,
    RoundMeta,
    SwarmView,
    Vote,
    claim_samples,
    decide_claims,
    decide_commit,
    progress_key,
    pick_blocks,
    accumulation_cap,
    should_resync,
    should_start_round,
    vote_key,
)
from ..protocol.manifest import DEFAULT_CHUNK_SIZE
from ..protocol.records import averager_prefix
from ..protocol.spec import Spec
from ..protocol.transfer import ProviderRecord, providers_key
from .averaging import RoundAverager, RoundOutcome
from .output import Events, set_log_context
from .access import AccessGate
from .swarm import record_validator, signed_subkey, subkey_owner
from .state import FrozenState, RunState, digest_tensors
from .catchup import CatchUp, Stopped
from .transfer import Fetcher, StateServer, admit_open, make_step_record
from .task import Task, batch_len, batch_to

logger = logging.getLogger("swarmrun.trainer")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Knobs of a trainer. Timeouts work on loopback and on a WAN; all are seconds."""

    batch_size: int = 16
    device: str = "cpu"
    max_steps: Optional[int] = None  # leave once the run reaches this step
    role: Role = Role.TRAINER
    report_interval: float = 0.5
    report_ttl: float = 8.0  # a peer whose report is older is not live
    matchmaking_time: float = 2.0
    request_timeout: float = 1.0
    averaging_timeout: float = 30.0  # matchmaking + all-reduce, per round
    allreduce_timeout: float = 20.0
    next_chunk_timeout: float = 4.0  # a silent peer is dropped from an all-reduce after this
    vote_timeout: float = 6.0
    state_timeout: float = 60.0
    mixed_precision: bool = True  # autocast to bf16 on CUDA
    max_failed_rounds: int = 50  # consecutive abandoned rounds before giving up
    min_peers: int = 1  # do not step until this many trainers are live (a demo or test waiting for its peers)
    finish_linger: float = 45.0  # a finished peer serves trainers still behind at most this long (> a round's wait)


class Trainer(CatchUp):
    """A peer of a run: trains (or keeps state), averages, commits, serves its state.

    Args:
        spec: the run's verified spec.
        task: the task built from it.
        dht: this peer's running DHT.
        events: where events go.
        state: the run state to start from (step 0 for a new run, or a downloaded one).
    """

    def __init__(self, *, spec: Spec, task: Task, dht: DHT, state: RunState, events: Events, config: TrainerConfig,
                 identity: RSAPrivateKey, gate: Optional[AccessGate] = None):
        self.spec, self.task, self.dht, self.state, self.events, self.config = spec, task, dht, state, events, config
        self.gate = gate if gate is not None else AccessGate(spec)
        # this peer's DHT records (progress, votes, provider records) are signed with its identity (its p2pd key):
        # no one writes in its name
        self._provider_subkey = signed_subkey(record_validator(identity), dht.peer_id.to_base58())
        self.device = torch.device(config.device)
        self.peer_id = dht.peer_id.to_base58()
        self.params = [p for p in state.model.parameters()]
        self.samples = 0  # samples accumulated toward the next step
        self.claimed = RangeSet()  # blocks whose gradients are in the accumulator
        self.view = SwarmView(reports={})
        self._seen: dict[str, float] = {}  # trainer -> when this peer last saw it live
        self.stop_requested = asyncio.Event()
        self.finished = False
        self.samples_per_second = 0.0
        self.last_loss: Optional[float] = None
        self.failed_rounds = 0
        self.stats = dict(steps_committed=0, rounds_abandoned=0, resyncs=0)
        self.server: Optional[StateServer] = None  # serves self.frozen and the step records to joiners
        self.fetcher: Optional[Fetcher] = None
        self._diverged = None  # the manifest of a replay that did not give the committers' state (diagnosis)
        self._record: Optional[FrozenState] = None  # the step record of the last commit, to publish
        self.frozen: Optional[FrozenState] = None  # the state of the current step, frozen (served, snapshotted)
        self.commit_hooks: list = []  # hook(frozen) after every committed step, in this loop; must not block
        self._state_hash = ""
        self.chunk_size = int(spec.hparams.get("chunk_size", DEFAULT_CHUNK_SIZE))
        self._record_bytes = sum(p.numel() * p.element_size() for p in self.params)  # one step record
        averaged = [torch.zeros_like(p, device="cpu") for p in self.params]
        self.averager = RoundAverager(
            averaged,
            dht,
            spec_hash=spec.spec_hash(),
            gate=self.gate,
            prefix=averager_prefix(spec.run_id),
            start=True,
            min_matchmaking_time=config.matchmaking_time,
            # hivemind: a request_timeout not below min_matchmaking_time can deadlock matchmaking
            request_timeout=min(config.request_timeout, 0.5 * config.matchmaking_time),
            allreduce_timeout=config.allreduce_timeout,
            next_chunk_timeout=config.next_chunk_timeout,
            target_group_size=None,
            min_group_size=2,
            auxiliary=config.role == Role.KEEPER,
            allow_state_sharing=False,  # state travels through swarmrun's own transfer (transfer.py)
            shutdown_timeout=3.0,
        )
        self._refresh_served_state()

    # ---- state served to joiners (frozen copy, refreshed after every commit) ------------------------
    def _refresh_served_state(self) -> None:
        """Freeze the state of the current step (runs in the worker thread; published from the loop)."""
        self.frozen = self.state.freeze(chunk_size=self.chunk_size)
        self._state_hash = self.frozen.manifest.state_hash()
        set_log_context(step=self.state.step)

    async def start_serving(self) -> None:
        """Serve this peer's state and step records over its p2pd, and fetch through it (idempotent)."""
        if self.server is not None:
            return
        p2p = await self.dht.replicate_p2p()
        admit = admit_open(self.spec.spec_hash(), self.gate)
        self.server = StateServer(p2p, self.spec.run_id, admit)
        await self.server.start()
        self.server.publish_state(self.frozen)
        self.fetcher = Fetcher(p2p, self.spec.run_id, self.spec.spec_hash(), chunk_timeout=self.config.next_chunk_timeout * 5,
                               credentials=self.gate.credentials)

    def _publish(self) -> None:
        if self.server is not None:
            self.server.publish_state(self.frozen)
            if self._record is not None:
                self.server.publish_record(self._record)
        self._record = None

    @property
    def state_hash(self) -> str:
        return self._state_hash

    # ---- the main loop ------------------------------------------------------------------------------
    async def run(self) -> str:
        """Train until the run finishes, ``max_steps`` is reached or a stop is requested.

        Returns:
            why it ended: "finished", "max_steps" or "stopped".
        """
        await self.start_serving()
        reporter = asyncio.create_task(self._report_forever())
        try:
            await self._refresh_view()
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
                    await asyncio.wait_for(self._publish_report(), 5.0)
                except asyncio.TimeoutError:
                    pass

    async def _iterate(self) -> Optional[str]:
        """One turn of the main loop; why the peer leaves, or None to go on."""
        if not (self.dht.is_alive() and self.averager.is_alive()):
            await asyncio.sleep(0.5)
            if self.stop_requested.is_set():
                return "stopped"
            raise SwarmrunError("hivemind's DHT or averager process died; leaving")
        if self.state.step >= self.spec.total_steps or self.view.finished():
            if self.state.step < self.spec.total_steps:
                # the others finished while this peer was behind: leave with the run's final state, if a
                # provider still serves it
                try:
                    await self.catch_up(deadline=time.monotonic() + min(20.0, self.config.state_timeout))
                except IncompatibleState as e:
                    logger.warning(f"the run finished; leaving at step {self.state.step}: {e}")
            self.finished = True
            await self._serve_laggards()
            return "finished"
        if self.config.max_steps is not None and self.state.step >= self.config.max_steps:
            return "max_steps"
        if self.stop_requested.is_set():
            return "stopped"
        if self.spec.access != "open":
            self.gate.check_self(self.peer_id)  # revoked or expired: leave with exit code 4 and the reason
        if self._behind():
            await self.resync()
        elif self.config.role == Role.KEEPER:
            await asyncio.sleep(self.config.report_interval)
        elif len(self.view.trainers) < self.config.min_peers:
            if self.samples < self.spec.target_batch_size:
                await self._compute_once()
            else:
                await asyncio.sleep(self.config.report_interval)
        elif should_start_round(self.view, me=self.peer_id, step=self.state.step, samples=self.samples,
                                target_batch_size=self._target()):
            await self.run_round()
        elif self.samples >= accumulation_cap(self.view, me=self.peer_id, step=self.state.step,
                                              samples_per_second=self.samples_per_second,
                                              target_batch_size=self._target()):
            await asyncio.sleep(0.05)  # our share is done: the others' next reports complete the target
        else:
            await self._compute_once()
        return None

    async def _serve_laggards(self) -> None:
        """Once finished, keep serving the final state (and reporting `finished`) while live trainers are still
        behind, bounded by ``finish_linger``. A peer that was waiting in a round when the others committed the
        last step learns it only when its round times out; without this it finds no provider and no `finished`
        report left (both expire with their TTL), and waits for peers forever."""
        deadline = time.monotonic() + self.config.finish_linger
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            if not any(p != self.peer_id and not r.finished for p, r in self.view.trainers.items()):
                return
            await asyncio.sleep(self.config.report_interval)

    def _target(self) -> int:
        """Samples a step needs: target_batch_size, or what is left of the data epoch (its last step is short)."""
        cursor, target = self.state.cursor, self.spec.target_batch_size
        pending = cursor.pending()
        if len(pending) * cursor.block_size > target + cursor.block_size:  # cheap: far from the epoch's end
            return target
        return min(target, claim_samples(pending, cursor))

    def _behind(self) -> bool:
        return should_resync(self.view, me=self.peer_id, step=self.state.step, state_hash=self.state_hash)

    # ---- gradients -----------------------------------------------------------------------------------
    def _take_blocks(self) -> list[int]:
        cursor = self.state.cursor
        count = max(1, math.ceil(self.config.batch_size / cursor.block_size))
        leased = self.view.leased(me=self.peer_id, step=self.state.step, data_epoch=cursor.data_epoch)
        members = sorted(set(self.view.trainers) | {self.peer_id})
        me = members.index(self.peer_id)
        # the fallback walk starts at this member's share of the order: apart from the others', and independent
        # of the peer's identity (a run resumed on one peer takes the same blocks as one that never paused)
        salt = me * cursor.num_blocks // len(members)
        return pick_blocks(cursor, count, member=me, members=len(members), exclude=self.claimed.add(leased), salt=salt)

    async def _compute_once(self) -> None:
        blocks = self._take_blocks()
        if not blocks:  # every block of the epoch is applied or claimed by us: wait for the round
            await asyncio.sleep(self.config.report_interval)
            return
        t0 = time.perf_counter()
        loss, n = await asyncio.to_thread(self._accumulate, blocks)
        dt = time.perf_counter() - t0
        self.samples += n
        self.claimed = self.claimed.add(RangeSet.from_items(blocks))
        self.last_loss = loss
        rate = n / max(dt, 1e-6)
        self.samples_per_second = rate if self.samples_per_second == 0 else 0.8 * self.samples_per_second + 0.2 * rate

    def _accumulate(self, blocks: list[int]) -> tuple[float, int]:
        """Add the per-sample sum of gradients of these blocks to ``param.grad`` (runs in a worker thread)."""
        cursor = self.state.cursor
        batch = batch_to(self.task.batch_for_blocks(blocks, cursor.block_size), self.device)
        n = batch_len(batch)
        model = self.state.model
        model.train()
        amp = self.device.type == "cuda" and self.config.mixed_precision
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = self.task.loss(model, batch)
        (loss.float() * n).backward()  # per-sample sum: any batch size weighs right
        return float(loss.detach()), n

    def _zero_accumulator(self) -> None:
        for p in self.params:
            p.grad = None
        self.samples = 0
        self.claimed = RangeSet()

    # ---- the round -----------------------------------------------------------------------------------
    def _meta(self) -> RoundMeta:
        return RoundMeta(spec_hash=self.spec.spec_hash(), step=self.state.step, samples=self.samples,
                         blocks=self.claimed, data_epoch=self.state.cursor.data_epoch, grad_norm=self._grad_norm(),
                         certificate=self.gate.credentials or b"")

    def _grad_norm(self) -> float:
        norms = [p.grad.detach().float().norm() for p in self.params if p.grad is not None]
        value = float(torch.stack(norms).norm()) / max(1, self.samples) if norms else 0.0
        return value if math.isfinite(value) else -1.0

    async def run_round(self) -> None:
        """One attempt at the next step. Commits, or abandons and keeps the accumulated gradients."""
        if len(self.view.trainers) <= 1 and self.samples >= self._target():
            await self._commit_alone()
            return
        meta = self._meta()
        if meta.grad_norm < 0:
            logger.warning("local gradient is not finite: dropping it and skipping this round")
            self._zero_accumulator()
            return
        with self.averager.get_tensors() as buffers:
            for buf, p in zip(buffers, self.params):
                if p.grad is None:
                    buf.zero_()
                else:
                    buf.copy_(p.grad.detach().float().cpu() / max(1, self.samples))
        self.averager.prepare_round(self.state.step, self.state.cursor, self.gate.revocations)
        t0 = time.perf_counter()
        try:
            control = self.averager.step(gather=meta.encode(), weight=float(max(self.samples, 1)),
                                         timeout=self.config.averaging_timeout, allow_retries=True, wait=False)
            outcome: RoundOutcome = await self._unless_stopped(_await(control, self.config.averaging_timeout + 5))
        except Stopped:
            raise
        except Exception as e:
            self._abandon(f"no round formed: {type(e).__name__}: {e}")
            await self._refresh_view()
            return
        decision, claims = await self._vote(outcome)
        if isinstance(decision, Commit):
            await asyncio.to_thread(self._apply_step, claims.applied, from_buffers=True)
            self._after_commit()
            self.events.emit("step", **self._step_fields(group=len(outcome.peer_ids), round_s=time.perf_counter() - t0,
                                                          samples=claims.samples, blocks=claims.applied.to_list()))
        else:
            me = outcome.peer_ids.index(self.peer_id) if self.peer_id in outcome.peer_ids else -1
            if me in claims.refused:
                logger.warning("my claimed blocks overlapped another participant's: dropping my accumulated gradients")
                self._zero_accumulator()
            self._abandon(decision.reason)

    async def _unless_stopped(self, awaitable):
        """Await, unless a stop is requested first (a leave must not wait out a round's timeout).

        Raises:
            Stopped: the stop came first (the round is abandoned; nothing was applied).
        """
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not task.done():
            task.cancel()
            raise Stopped()
        return task.result()

    async def _vote(self, outcome: RoundOutcome):
        claims = decide_claims(outcome.metas, self.state.cursor)
        with self.averager.get_tensors() as buffers:
            finite = all(bool(torch.isfinite(b).all()) for b in buffers)
            grad_hash = digest_tensors(buffers)
        ok = outcome.complete and finite
        reason = outcome.reason if not outcome.complete else ("" if finite else "averaged gradient is not finite")
        live = max(self._recently_live(), len(outcome.peer_ids))
        mine = Vote(step=self.state.step, group_id=outcome.group_id.hex(), grad_hash=grad_hash, ok=ok, reason=reason,
                    live=live)
        key = vote_key(self.spec.run_id, self.state.step)
        await _await(self.dht.store(key, subkey=self._provider_subkey, value=mine.encode(),
                                    expiration_time=get_dht_time() + 120, return_future=True))
        deadline = time.monotonic() + self.config.vote_timeout
        votes: dict[str, Vote] = {}
        while True:
            # a vote of an earlier attempt at this step (another group) is not a vote in this round
            votes = {p: v for p, v in (await self._read_votes(key)).items() if v.group_id == mine.group_id}
            if not ok or all(p in votes for p in outcome.peer_ids) or time.monotonic() > deadline:
                break
            if any(not v.ok for v in votes.values() if v.group_id == mine.group_id):
                break
            await asyncio.sleep(0.05)
        decision = decide_commit(mine=mine, votes=votes, group=outcome.peer_ids, live_trainers=live,
                                 samples=claims.samples, target_batch_size=self._target())
        return decision, claims

    async def _read_votes(self, key: str) -> dict[str, Vote]:
        return await read_subkeys(self.dht, key, Vote.decode, signed=True)

    def _abandon(self, reason: str) -> None:
        self.stats["rounds_abandoned"] += 1
        self.failed_rounds += 1
        logger.warning(f"round abandoned: {reason}")
        self.events.emit("round_abandoned", step=self.state.step, reason=reason)
        if self.failed_rounds > self.config.max_failed_rounds:
            raise IncompatibleState(f"{self.failed_rounds} rounds in a row were abandoned; last: {reason}")

    async def _commit_alone(self) -> None:
        """The only live trainer commits its own gradient: a group of one is the whole run."""
        claims = decide_claims([self._meta()], self.state.cursor)
        if claims.refused:
            self._zero_accumulator()
            return
        await asyncio.to_thread(self._apply_step, claims.applied, from_buffers=False)
        self._after_commit()
        self.events.emit("step", **self._step_fields(group=1, round_s=0.0, samples=claims.samples,
                                                      blocks=claims.applied.to_list()))

    def _apply_step(self, applied: RangeSet, *, from_buffers: bool) -> None:
        """The committed step: the optimizer on the (identical) averaged gradient, then cursor and step advance."""
        if from_buffers:
            with self.averager.get_tensors() as buffers:
                grads = [buf.to(p.device, dtype=p.dtype, copy=True) for p, buf in zip(self.params, buffers)]
        else:
            grads = [None if p.grad is None else p.grad.div_(max(1, self.samples)) for p in self.params]
        before = self.state_hash
        self._optimizer_step(grads, applied)
        self._zero_accumulator()
        self.failed_rounds = 0
        self.stats["steps_committed"] += 1
        self._record = make_step_record(spec_hash=self.spec.spec_hash(), step=self.state.step - 1, grads=grads,
                                        applied=applied, data_epoch=self.state.cursor.data_epoch,
                                        state_hash_before=before, state_hash_after=self.state_hash,
                                        chunk_size=self.chunk_size)
        every = int(self.spec.hparams.get("eval_every", 0))
        if every and self.state.step % every == 0 or self.state.step == self.spec.total_steps:
            loss = self.task.evaluate(self.state.model, self.device)
            self.events.emit("eval", step=self.state.step, loss=loss)

    def _optimizer_step(self, grads: list[Optional[torch.Tensor]], applied: RangeSet) -> None:
        """Step ``step -> step + 1`` with these gradients: the same code for a commit and for a replayed step
        record, so a replay gives the committers' bits."""
        for p, g in zip(self.params, grads):
            p.grad = None if g is None else g.to(p.device, dtype=p.dtype, copy=True)  # clipping works in place
        clip = float(self.spec.hparams.get("clip_norm", 0.0))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=False)
        self.state.optimizer.step()
        self.state.scheduler.step()
        self.state.step += 1
        self.state.cursor = self.state.cursor.apply(applied)
        for p in self.params:
            p.grad = None
        self._refresh_served_state()

    def _after_commit(self) -> None:
        self._publish()
        for hook in list(self.commit_hooks):
            try:
                hook(self.frozen)
            except Exception as e:  # a hook (snapshot writer, ...) must not take the trainer down
                logger.warning(f"commit hook {getattr(hook, '__name__', hook)!r} failed: {type(e).__name__}: {e}")

    def _step_fields(self, **extra) -> dict:
        trainers = self.view.trainers
        sps = sum(r.samples_per_second for p, r in trainers.items() if p != self.peer_id) + self.samples_per_second
        remaining = max(0, self.spec.total_steps - self.state.step) * self.spec.target_batch_size
        return dict(step=self.state.step, total_steps=self.spec.total_steps, loss=self.last_loss,
                    samples_accumulated=self.samples,
                    state_hash=self.state_hash, samples_per_second=round(sps, 2), peers=max(1, len(trainers)),
                    eta_s=(remaining / sps) if sps > 0 else None, cursor=self.state.cursor.summary(), **extra)

    # ---- progress reports ----------------------------------------------------------------------------
    def _report(self) -> ProgressReport:
        # a leaving peer releases its blocks in its last report rather than holding them until the report expires
        leaving = self.finished or self.stop_requested.is_set() or (
            self.config.max_steps is not None and self.state.step >= self.config.max_steps)
        return ProgressReport(step=self.state.step, samples=self.samples, samples_per_second=self.samples_per_second,
                              role=self.config.role, state_hash=self.state_hash, time=get_dht_time(),
                              finished=self.finished or self.state.step >= self.spec.total_steps,
                              certificate=self.gate.credentials or b"",
                              claimed=RangeSet() if leaving else self.claimed, data_epoch=self.state.cursor.data_epoch,
                              cursor=self.state.cursor.summary())

    def _provider_record(self) -> Optional[ProviderRecord]:
        if self.server is None or self.frozen is None:
            return None
        return ProviderRecord(step=self.state.step, manifest_hash=self.frozen.manifest.manifest_hash(),
                              state_hash=self.state_hash, total_bytes=self.frozen.manifest.total_bytes,
                              time=get_dht_time(), keeper=self.config.role == Role.KEEPER,
                              serving=self.server.sessions, log=self.server.announced_log())

    async def _publish_report(self) -> None:
        record = self._provider_record()
        if record is not None:
            try:
                await _await(self.dht.store(providers_key(self.spec.run_id), subkey=self._provider_subkey, value=record.encode(),
                                            expiration_time=get_dht_time() + self.config.report_ttl, return_future=True))
            except Exception as e:
                logger.debug(f"could not announce the served state: {e!r}")
        try:
            await _await(self.dht.store(progress_key(self.spec.run_id), subkey=self._provider_subkey,
                                        value=self._report().encode(),
                                        expiration_time=get_dht_time() + self.config.report_ttl, return_future=True))
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    def _recently_live(self) -> int:
        """Trainers seen live within the report TTL (a high-water mark: a view that is still forming, at a start or
        under load, must not make a minority look like a majority)."""
        now = time.monotonic()
        for peer in self.view.trainers:
            self._seen[peer] = now
        self._seen = {p: t for p, t in self._seen.items() if now - t <= self.config.report_ttl}
        return len(self._seen | {self.peer_id: now})

    async def _refresh_view(self) -> None:
        self.view = await read_view(self.dht, self.spec.run_id, self.gate)
        reports = dict(self.view.reports)
        reports[self.peer_id] = self._report()
        self.view = SwarmView(reports=reports)
        self._recently_live()

    async def _report_forever(self) -> None:
        last_refresh = 0.0
        while True:
            await self._publish_report()
            try:
                await self._refresh_view()
                if self.spec.access != "open" and time.monotonic() - last_refresh > 5.0:
                    await self.gate.refresh(self.dht)  # the owner's revocations
                    last_refresh = time.monotonic()
            except Exception as e:
                logger.debug(f"could not read progress: {e!r}")
            if self.config.role == Role.TRAINER and self.state.step > 0:
                self.events.emit("progress", **self._step_fields())
            await asyncio.sleep(self.config.report_interval)

    async def stop_serving(self) -> None:
        if self.server is not None and self.dht.is_alive():
            try:
                await asyncio.wait_for(self.server.stop(), 3.0)  # p2pd may be gone: never hang on the way out
            except asyncio.TimeoutError:
                pass

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"averager shutdown: {e!r}")


async def read_subkeys(dht: DHT, key: str, decode, *, signed: bool = False) -> dict:
    """The decoded values of a DHT key's subkeys, by peer id (malformed ones are ignored). ``signed``: only records
    signed by the peer their subkey names (progress reports, votes)."""
    found = await _await(dht.get(key, latest=True, return_future=True))
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            owner = subkey_owner(subkey)
            if owner is None and not signed and isinstance(subkey, str):
                owner = subkey
            if owner is None:
                continue
            try:
                out[owner] = decode(item.value)
            except (ProtocolError, AttributeError, TypeError):
                continue
    return out


async def read_view(dht: DHT, run_id: str, gate: Optional[AccessGate] = None) -> SwarmView:
    """The live progress reports of a run, by peer id: signed by that peer and, in an invite-only run, carrying a
    certificate the gate admits (a report from anyone else is not part of the run)."""
    reports = await read_subkeys(dht, progress_key(run_id), ProgressReport.decode, signed=True)
    if gate is not None and gate.spec.access != "open":
        reports = {p: r for p, r in reports.items() if gate.check(p, r.certificate) is None}
    return SwarmView(reports=reports)


async def read_providers(dht: DHT, run_id: str) -> dict[str, ProviderRecord]:
    """The live provider records of a run, by peer id: only records signed by the peer they name (hivemind's
    validator checked the signature; ``subkey_owner`` that the key is that peer's identity); malformed ones
    are ignored."""
    found = await _await(dht.get(providers_key(run_id), latest=True, return_future=True))
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            owner = subkey_owner(subkey)
            if owner is None:
                continue
            try:
                out[owner] = ProviderRecord.decode(item.value)
            except (ProtocolError, AttributeError, TypeError):
                continue
    return out


async def _await(mpfuture, timeout: float = 30.0):
    """Await a hivemind MPFuture, bounded: if its process died, the future would never resolve."""
    return await asyncio.wait_for(asyncio.ensure_future(_wrap(mpfuture)), timeout)


async def _wrap(mpfuture):
    return await mpfuture
