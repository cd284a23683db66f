"""The trainer: accumulate per-sample gradients on unapplied blocks, run rounds, commit steps, re-sync.

One asyncio loop; the gradient computation and the optimizer step run in a worker thread. hivemind's DHT
and averager run in their own processes and are reached through their public API (MPFutures are awaited).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from ..protocol.cursor import RangeSet, block_examples
from ..protocol.errors import IncompatibleState, ProtocolError, SwarmrunError
from ..protocol.manifest import Manifest
from ..protocol.round import (
    Abandon,
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
    preferred_hash,
    should_resync,
    should_start_round,
    vote_key,
)
from ..protocol.spec import Spec
from .averaging import RoundAverager, RoundOutcome
from .output import Events, set_log_context
from .state import RunState, digest_tensors, tensor_bytes, tensor_from_bytes
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


class Trainer:
    """A peer of a run: trains (or keeps state), averages, commits, serves its state.

    Args:
        spec: the run's verified spec.
        task: the task built from it.
        dht: this peer's running DHT.
        events: where events go.
        state: the run state to start from (step 0 for a new run, or a downloaded one).
    """

    def __init__(self, *, spec: Spec, task: Task, dht: DHT, state: RunState, events: Events, config: TrainerConfig):
        self.spec, self.task, self.dht, self.state, self.events, self.config = spec, task, dht, state, events, config
        self.device = torch.device(config.device)
        self.peer_id = dht.peer_id.to_base58()
        self.params = [p for p in state.model.parameters()]
        self.samples = 0  # samples accumulated toward the next step
        self.claimed = RangeSet()  # blocks whose gradients are in the accumulator
        self.walk = zlib.crc32(self.peer_id.encode()) % max(1, state.cursor.num_blocks)
        self.view = SwarmView(reports={})
        self.stop_requested = asyncio.Event()
        self.finished = False
        self.samples_per_second = 0.0
        self.last_loss: Optional[float] = None
        self.failed_rounds = 0
        self.stats = dict(steps_committed=0, rounds_abandoned=0, resyncs=0)
        self._served = None
        self._state_hash = ""
        averaged = [torch.zeros_like(p, device="cpu") for p in self.params]
        self.averager = RoundAverager(
            averaged,
            dht,
            spec_hash=spec.spec_hash(),
            state_source=self._current_state,
            prefix=f"swarmrun_{spec.run_id}",
            start=True,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=config.request_timeout,
            allreduce_timeout=config.allreduce_timeout,
            next_chunk_timeout=config.next_chunk_timeout,
            target_group_size=None,
            min_group_size=2,
            auxiliary=config.role == Role.KEEPER,
            allow_state_sharing=True,
            declare_state_period=5.0,
            shutdown_timeout=3.0,
        )
        self._refresh_served_state()

    # ---- state served to joiners (frozen copy, refreshed after every commit) ------------------------
    def _refresh_served_state(self) -> None:
        tensors, content = self.state.capture()
        manifest = self.state.manifest(captured=(tensors, content))
        self._state_hash = manifest.state_hash()
        self._served = (dict(manifest=manifest.encode()), [t for _, t in tensors], None)
        self.averager.state_sharing_priority = float(self.state.step)
        set_log_context(step=self.state.step)

    def _current_state(self):
        return self._served

    @property
    def state_hash(self) -> str:
        return self._state_hash

    # ---- the main loop ------------------------------------------------------------------------------
    async def run(self) -> str:
        """Train until the run finishes, ``max_steps`` is reached or a stop is requested.

        Returns:
            why it ended: "finished", "max_steps" or "stopped".
        """
        reporter = asyncio.create_task(self._report_forever())
        try:
            await self._refresh_view()
            while True:
                if not (self.dht.is_alive() and self.averager.is_alive()):
                    raise SwarmrunError("hivemind's DHT or averager process died; leaving")
                if self.state.step >= self.spec.total_steps or self.view.finished():
                    self.finished = True
                    return "finished"
                if self.config.max_steps is not None and self.state.step >= self.config.max_steps:
                    return "max_steps"
                if self.stop_requested.is_set():
                    return "stopped"
                if self._behind():
                    await self.resync()
                    continue
                if self.config.role == Role.KEEPER:
                    await asyncio.sleep(self.config.report_interval)
                    continue
                if len(self.view.trainers) < self.config.min_peers:
                    if self.samples < self.spec.target_batch_size:
                        await self._compute_once()
                    else:
                        await asyncio.sleep(self.config.report_interval)
                    continue
                if should_start_round(self.view, me=self.peer_id, step=self.state.step, samples=self.samples,
                                      target_batch_size=self._target()):
                    await self.run_round()
                else:
                    await self._compute_once()
        finally:
            reporter.cancel()
            if self.dht.is_alive():
                await self._publish_report()  # the last word: finished or where we stopped

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
        return pick_blocks(cursor, count, member=members.index(self.peer_id), members=len(members),
                           exclude=self.claimed.add(leased), salt=self.walk)

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
                         blocks=self.claimed, data_epoch=self.state.cursor.data_epoch, grad_norm=self._grad_norm())

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
        self.averager.prepare_round(self.state.step, self.state.cursor)
        t0 = time.perf_counter()
        try:
            control = self.averager.step(gather=meta.encode(), weight=float(max(self.samples, 1)),
                                         timeout=self.config.averaging_timeout, allow_retries=True, wait=False)
            outcome: RoundOutcome = await _await(control, self.config.averaging_timeout + 5)
        except Exception as e:
            self._abandon(f"no round formed: {type(e).__name__}: {e}")
            await self._refresh_view()
            return
        decision, claims = await self._vote(outcome)
        if isinstance(decision, Commit):
            await asyncio.to_thread(self._apply_step, claims.applied, from_buffers=True)
            self.events.emit("step", **self._step_fields(group=len(outcome.peer_ids), round_s=time.perf_counter() - t0,
                                                          samples=claims.samples))
        else:
            me = outcome.peer_ids.index(self.peer_id) if self.peer_id in outcome.peer_ids else -1
            if me in claims.refused:
                logger.warning("my claimed blocks overlapped another participant's: dropping my accumulated gradients")
                self._zero_accumulator()
            self._abandon(decision.reason)

    async def _vote(self, outcome: RoundOutcome):
        claims = decide_claims(outcome.metas, self.state.cursor)
        with self.averager.get_tensors() as buffers:
            finite = all(bool(torch.isfinite(b).all()) for b in buffers)
            grad_hash = digest_tensors(buffers)
        ok = outcome.complete and finite
        reason = outcome.reason if not outcome.complete else ("" if finite else "averaged gradient is not finite")
        mine = Vote(step=self.state.step, group_id=outcome.group_id.hex(), grad_hash=grad_hash, ok=ok, reason=reason)
        key = vote_key(self.spec.run_id, self.state.step)
        await _await(self.dht.store(key, subkey=self.peer_id, value=mine.encode(),
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
        live = max(len(self.view.trainers), len(outcome.peer_ids))
        decision = decide_commit(mine=mine, votes=votes, group=outcome.peer_ids, live_trainers=live,
                                 samples=claims.samples, target_batch_size=self._target())
        return decision, claims

    async def _read_votes(self, key: str) -> dict[str, Vote]:
        return await read_subkeys(self.dht, key, Vote.decode)

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
        self.events.emit("step", **self._step_fields(group=1, round_s=0.0, samples=claims.samples))

    def _apply_step(self, applied: RangeSet, *, from_buffers: bool) -> None:
        """The optimizer step in fp32 on the (identical) averaged gradient, then cursor and step advance."""
        if from_buffers:
            with self.averager.get_tensors() as buffers:
                for p, buf in zip(self.params, buffers):
                    p.grad = buf.to(p.device, dtype=p.dtype, copy=True)
        else:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(max(1, self.samples))
        clip = float(self.spec.hparams.get("clip_norm", 0.0))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=False)
        self.state.optimizer.step()
        self.state.scheduler.step()
        self.state.step += 1
        self.state.cursor = self.state.cursor.apply(applied)
        self._zero_accumulator()
        self.failed_rounds = 0
        self.stats["steps_committed"] += 1
        self._refresh_served_state()
        every = int(self.spec.hparams.get("eval_every", 0))
        if every and self.state.step % every == 0 or self.state.step == self.spec.total_steps:
            loss = self.task.evaluate(self.state.model, self.device)
            self.events.emit("eval", step=self.state.step, loss=loss)

    def _step_fields(self, **extra) -> dict:
        trainers = self.view.trainers
        sps = sum(r.samples_per_second for p, r in trainers.items() if p != self.peer_id) + self.samples_per_second
        remaining = max(0, self.spec.total_steps - self.state.step) * self.spec.target_batch_size
        return dict(step=self.state.step, total_steps=self.spec.total_steps, loss=self.last_loss,
                    state_hash=self.state_hash, samples_per_second=round(sps, 2), peers=max(1, len(trainers)),
                    eta_s=(remaining / sps) if sps > 0 else None, cursor=self.state.cursor.summary(), **extra)

    # ---- re-sync and bootstrap -----------------------------------------------------------------------
    async def resync(self) -> None:
        """Download the newest state from a provider, verify it, apply it (drops local accumulation)."""
        before = self.state.step
        t0 = time.perf_counter()
        await load_state_from_swarm(self.averager, self.state, self.view, timeout=self.config.state_timeout,
                                    me=self.peer_id)
        self._zero_accumulator()
        self._refresh_served_state()
        self.stats["resyncs"] += 1
        self.events.emit("resync", from_step=before, step=self.state.step, state_hash=self.state_hash,
                         seconds=round(time.perf_counter() - t0, 3))

    # ---- progress reports ----------------------------------------------------------------------------
    def _report(self) -> ProgressReport:
        # a leaving peer releases its blocks in its last report rather than holding them until the report expires
        leaving = self.finished or self.stop_requested.is_set() or (
            self.config.max_steps is not None and self.state.step >= self.config.max_steps)
        return ProgressReport(step=self.state.step, samples=self.samples, samples_per_second=self.samples_per_second,
                              role=self.config.role, state_hash=self.state_hash, time=get_dht_time(),
                              finished=self.finished or self.state.step >= self.spec.total_steps,
                              claimed=RangeSet() if leaving else self.claimed, data_epoch=self.state.cursor.data_epoch,
                              cursor=self.state.cursor.summary())

    async def _publish_report(self) -> None:
        try:
            await _await(self.dht.store(progress_key(self.spec.run_id), subkey=self.peer_id,
                                        value=self._report().encode(),
                                        expiration_time=get_dht_time() + self.config.report_ttl, return_future=True))
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    async def _refresh_view(self) -> None:
        self.view = await read_view(self.dht, self.spec.run_id)
        reports = dict(self.view.reports)
        reports[self.peer_id] = self._report()
        self.view = SwarmView(reports=reports)

    async def _report_forever(self) -> None:
        while True:
            await self._publish_report()
            try:
                await self._refresh_view()
            except Exception as e:
                logger.debug(f"could not read progress: {e!r}")
            if self.config.role == Role.TRAINER and self.state.step > 0:
                self.events.emit("progress", **self._step_fields())
            await asyncio.sleep(self.config.report_interval)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"averager shutdown: {e!r}")


async def read_subkeys(dht: DHT, key: str, decode) -> dict:
    """The decoded values of a DHT key's subkeys, by subkey (malformed ones are ignored)."""
    found = await _await(dht.get(key, latest=True, return_future=True))
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            try:
                out[str(subkey)] = decode(item.value)
            except (ProtocolError, AttributeError, TypeError):
                continue
    return out


async def read_view(dht: DHT, run_id: str) -> SwarmView:
    """The live progress reports of a run, by peer id (malformed ones are ignored)."""
    return SwarmView(reports=await read_subkeys(dht, progress_key(run_id), ProgressReport.decode))


async def load_state_from_swarm(averager: RoundAverager, state: RunState, view: SwarmView, *, timeout: float,
                                me: str = "") -> None:
    """Fetch a provider's state through hivemind's download path, verify every tensor against the manifest and
    the manifest's state_hash against what live trainers report for that step, and apply it.

    Raises:
        IncompatibleState: nothing verified could be fetched within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    last_error = "no provider answered"
    while time.monotonic() < deadline:
        result = await _await(averager.load_state_from_peers(wait=False, timeout=min(30.0, timeout)))
        if result is None:
            await asyncio.sleep(0.5)
            continue
        metadata, tensors = result
        try:
            manifest, named = verify_downloaded(metadata, tensors, state.spec_hash)
        except (IncompatibleState, ProtocolError) as e:
            last_error = str(e)
            await asyncio.sleep(0.5)
            continue
        wanted = preferred_hash(view, step=manifest.step, me=me)
        if wanted is not None and manifest.state_hash() != wanted:
            last_error = f"downloaded state of step {manifest.step} is not the one live trainers report"
            await asyncio.sleep(0.5)
            continue
        state.apply(manifest, named)
        return
    raise IncompatibleState(f"could not fetch a verified state: {last_error}")


def verify_downloaded(metadata, tensors, spec_hash: str) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Check received tensors byte for byte against the manifest sent with them."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("manifest"), bytes):
        raise IncompatibleState("provider sent no manifest")
    manifest = Manifest.decode(metadata["manifest"])
    if manifest.spec_hash != spec_hash:
        raise IncompatibleState("provider's state belongs to another spec")
    if len(tensors) != len(manifest.tensors):
        raise IncompatibleState(f"provider sent {len(tensors)} tensors, its manifest lists {len(manifest.tensors)}")
    named = {}
    for entry, t in zip(manifest.tensors, tensors):
        raw = tensor_bytes(t.cpu())
        if hashlib.sha256(raw).hexdigest() != entry.digest or tuple(t.shape) != tuple(entry.shape):
            raise IncompatibleState(f"tensor {entry.name} does not match its manifest hash")
        named[entry.name] = tensor_from_bytes(raw, entry.dtype, entry.shape)
    return manifest, named


async def _await(mpfuture, timeout: float = 30.0):
    """Await a hivemind MPFuture, bounded: if its process died, the future would never resolve."""
    return await asyncio.wait_for(asyncio.ensure_future(_wrap(mpfuture)), timeout)


async def _wrap(mpfuture):
    return await mpfuture
