"""One round: an attempt at a collective step on hivemind's averager (``averaging.RoundAverager``), then the commit
vote in the DHT. The round decides (``decide_claims``, ``decide_commit``, pure functions in ``protocol.round``);
applying a committed step is the trainer's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Optional, Sequence

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.records import read_subkeys
from swarmrun.node.peer.averaging import RoundAverager, RoundOutcome
from swarmrun.node.peer.codecs import make_codec
from swarmrun.node.peer.feedback import ErrorFeedback
from swarmrun.node.runtime import await_future
from swarmrun.node.state.run import digest_tensors
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.errors import Stopped
from swarmrun.protocol.records import averager_prefix
from swarmrun.protocol.round import (Abandon, ClaimDecision, Commit, Role, RoundMeta, Vote, decide_claims,
                                     decide_commit, held_by_others, majority_round, round_votes, vote_key,
                                     vote_wait_over)
from swarmrun.protocol.spec import Spec

VOTE_TTL = 120.0  # seconds a vote stays in the DHT (a round's members read it within vote_timeout)
VOTE_POLL = 0.05
MOVED_ON_POLL = 0.25  # seconds between two looks at the swarm while this peer's group forms
AVERAGER_SHUTDOWN_TIMEOUT = 3.0  # hivemind's averager process, at the peer's leave


class SwarmMovedOn(Exception):
    """No group can form for this round: the others committed its step while this peer was still looking for one
    (``passed``), or no other trainer is left in the view (a crash or a partition)."""

    def __init__(self, reason: str, *, passed: bool = True):
        super().__init__(reason)
        self.passed = passed


@dataclass(frozen=True)
class RoundResult:
    """What a round came to: the decision (``Commit`` or ``Abandon``), the claims, and who took part."""

    decision: object
    claims: ClaimDecision
    outcome: RoundOutcome
    seconds: float
    vote_seconds: float = 0.0  # of ``seconds``: from the all-reduce's end to the decision


def make_averager(params: Sequence[torch.Tensor], dht: DHT, *, spec: Spec, gate, config) -> RoundAverager:
    """The run's averager: one buffer per parameter, on the CPU; matchmaking under the run's prefix; the all-reduce
    in the spec's codec (``Spec.compression``)."""
    averaged = [torch.zeros_like(p, device="cpu") for p in params]
    return RoundAverager(
        averaged,
        dht,
        spec_hash=spec.spec_hash(),
        gate=gate,
        feedback=ErrorFeedback(averaged) if spec.error_feedback and config.role != Role.KEEPER else None,  # sends
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
        compression=make_codec(spec.compression),
        allow_state_sharing=False,  # state travels through swarmrun's own transfer (net/serve.py, net/fetch.py)
        shutdown_timeout=AVERAGER_SHUTDOWN_TIMEOUT,
    )


class RoundRunner:
    """Runs rounds for one peer.

    Args:
        subkey: this peer's signed subkey (its vote carries its signature).
        live: how many trainers this peer saw live lately (the commit rule's majority is of those).
        members: the run's membership as this peer remembers it (``Reporter.members``; its vote carries it).
        moved_on: whether the swarm's view shows a trainer past this peer's step (then a group still forming for
            it never will: the round gives up at once instead of waiting out ``averaging_timeout``).
        alone: whether no other trainer was seen live lately (the round gives up at once too).
        stop_requested: a stop abandons the round in flight at once (nothing is applied).
    """

    def __init__(self, *, averager: RoundAverager, dht: DHT, spec: Spec, gate, config, subkey: bytes,
                 live: Callable[[], int], moved_on: Callable[[], bool], stop_requested: asyncio.Event,
                 members: Callable[[], int] = lambda: 0, alone: Callable[[], bool] = lambda: False):
        self.averager, self.dht, self.spec, self.gate, self.config = averager, dht, spec, gate, config
        self.subkey, self.live, self.moved_on, self.stop_requested = subkey, live, moved_on, stop_requested
        self.members, self.alone = members, alone
        # set once the round in flight has a group (its all-reduce started): work that would compete for a core with
        # members still computing their parts waits for it (``Trainer._attempt``)
        self.formed = asyncio.Event()
        self._held_elsewhere: tuple = (None, None, {})  # (step, applied blocks, {member: blocks}) of the last round

    def held_elsewhere(self, cursor: DataCursor, step: int, live: Collection[str]) -> RangeSet:
        """The blocks the other members of this peer's last round at this state (``step`` and ``cursor``) claimed
        (``held_by_others``), of those still ``live``: a member that vanished holds nothing (its blocks would stay
        out of reach for good, and at a data epoch's end the step could never fill)."""
        at, applied, held = self._held_elsewhere
        if at != step or applied != cursor.applied:
            return RangeSet()
        out = RangeSet()
        for peer, blocks in held.items():
            if peer in live:
                out = out.add(blocks)
        return out

    def load(self, grads: Sequence[torch.Tensor | None], samples: int, *, meta: RoundMeta) -> RoundMeta:
        """Put this peer's mean gradient (the per-sample sum / samples) in the averager's buffers; with error feedback
        (``feedback.py``) plus the residual carried from the last round, and ``meta`` declares the norm of the sum
        (reducers check each slice against it). The meta to send."""
        with self.averager.get_tensors() as buffers:
            for buf, g in zip(buffers, grads):
                if g is None:
                    buf.zero_()
                else:
                    buf.copy_(g.detach().float().cpu() / max(1, samples))
            if self.averager.feedback is None:
                return meta
            return replace(meta, grad_norm=self.averager.feedback.add_to(buffers, meta.step, meta.samples))

    async def attempt(self, meta: RoundMeta, *, cursor: DataCursor, target: int, tolerance: float,
                      eta: float = 0.0, group_size: Optional[int] = None) -> RoundResult:
        """Average the loaded gradient with a group, then vote.

        ``eta``: seconds until the slowest member of the step plan should have computed its part; the group is
        declared until then (and at least ``matchmaking_time``), and assembles at once when it holds ``group_size``.

        Raises:
            Stopped: a stop came first. SwarmMovedOn: the others committed the step before a group formed.
            Exception: no group formed, or the averager failed (the round is abandoned).
        """
        self.averager.prepare_round(meta.step, cursor, self.gate.revocations, target=target, tolerance=tolerance,
                                    group_size=group_size, live=self.live())
        t0 = time.perf_counter()
        # hivemind's followers join a leader whose declaration expires before theirs. A member that finishes early
        # declares until two matchmaking times after the slowest should be done; the last one (eta 0) declares
        # three: so it joins the early ones' group instead of leading one they must move to, and a member slower
        # than its reported speed still makes it. A full group assembles at once (target_group_size), so the margin
        # costs only when a planned member does not come
        mm = self.config.matchmaking_time
        scheduled = get_dht_time() + (eta + 2 * mm if eta > 0 else 3 * mm)
        control = self.averager.step(gather=meta.encode(), weight=float(max(meta.samples, 1)), scheduled_time=scheduled,
                                     timeout=self.config.averaging_timeout + eta, allow_retries=True, wait=False)
        outcome: RoundOutcome = await self._unless_stopped(self._outcome(control, eta))
        t1 = time.perf_counter()
        decision, claims = await self._vote(outcome, step=meta.step, cursor=cursor, target=target, tolerance=tolerance)
        if isinstance(decision, Abandon) and claims.samples <= 0:
            # a group of members with nothing to bring: look again on the next reports, not at once (the outer
            # trace's joiners met each other empty-handed and abandoned such a round every ~0.1 s while the creator
            # computed the step: 4 and 6 of 7 and 9 distinct abandoned rounds in two runs)
            await asyncio.sleep(self.config.report_interval)
        me = self.averager.peer_id.to_base58()
        held = held_by_others(outcome.metas, outcome.peer_ids, me=me, refused=claims.refused)
        self._held_elsewhere = (meta.step, cursor.applied, held)
        if isinstance(decision, Commit) and self.averager.feedback is not None:
            # what this round's encoding lost goes into the next one; a refused claim (weight 0) delivered nothing
            self.averager.feedback.committed(meta.step, samples=meta.samples,
                                             delivered=claims.weights[outcome.peer_ids.index(me)] > 0)
        return RoundResult(decision, claims, outcome, time.perf_counter() - t0, time.perf_counter() - t1)

    def start(self, meta: RoundMeta, **kwargs) -> asyncio.Future:
        """``attempt`` as a task; ``formed`` is set once its group formed (``until_formed``)."""
        self.formed.clear()
        return asyncio.ensure_future(self.attempt(meta, **kwargs))

    async def until_formed(self, attempt: asyncio.Future) -> None:
        """Until the round in flight (``attempt``, from ``start``) has its group, or ended."""
        formed = asyncio.ensure_future(self.formed.wait())
        try:
            await asyncio.wait([attempt, formed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            formed.cancel()

    async def _outcome(self, control, eta: float = 0.0) -> RoundOutcome:
        """The averager's outcome; a round still looking for a group is cancelled once the swarm moved past its
        step, or no other trainer is left in the view (only while matchmaking: a formed group's all-reduce is never
        left half-way by this peer)."""
        result = asyncio.ensure_future(await_future(control, self.config.averaging_timeout + eta + 5))
        try:
            while not result.done():
                await asyncio.wait([result], timeout=MOVED_ON_POLL)
                if result.done() or control.stage != AveragingStage.LOOKING_FOR_GROUP:
                    self.formed.set()
                    continue
                if self.moved_on() and control.cancel():
                    raise SwarmMovedOn("the swarm committed this step before a group formed")
                if self.alone() and control.cancel():  # no other trainer left to form a group with
                    raise SwarmMovedOn("no other trainer is live", passed=False)
            return result.result()
        finally:
            result.cancel()

    async def _unless_stopped(self, awaitable):
        """Await, unless a stop is requested first (a leave must not wait out a round's timeout)."""
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

    async def _vote(self, outcome: RoundOutcome, *, step: int, cursor: DataCursor, target: int, tolerance: float):
        claims = decide_claims(outcome.metas, cursor, target=target, tolerance=tolerance)
        with self.averager.get_tensors() as buffers:
            finite = all(bool(torch.isfinite(b).all()) for b in buffers)
            grad_hash = digest_tensors(buffers)
        ok = outcome.complete and finite
        reason = outcome.reason if not outcome.complete else ("" if finite else "averaged gradient is not finite")
        live = max(self.live(), len(outcome.peer_ids))
        mine = Vote(step=step, group_id=outcome.group_id.hex(), grad_hash=grad_hash, ok=ok, reason=reason, live=live,
                    members=max(self.members(), live))
        key = vote_key(self.spec.run_id, step)
        await await_future(self.dht.store(key, subkey=self.subkey, value=mine.encode(),
                                          expiration_time=get_dht_time() + VOTE_TTL, return_future=True))
        deadline = time.monotonic() + self.config.vote_timeout
        while True:
            # only members of this round's group vote in it: a stranger's vote (or an earlier group's) is ignored
            votes = round_votes(await read_subkeys(self.dht, key, Vote.decode, signed=True),
                                group=outcome.peer_ids, group_id=mine.group_id, step=step)
            if vote_wait_over(mine=mine, votes=votes, group=outcome.peer_ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(VOTE_POLL)
        decision = decide_commit(mine=mine, votes=votes, group=outcome.peer_ids, live_trainers=live,
                                 samples=claims.samples, target_batch_size=target, tolerance=tolerance)
        if isinstance(decision, Commit):
            decision = Commit(majority=majority_round(votes, outcome.peer_ids))
        return decision, claims
