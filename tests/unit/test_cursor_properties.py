"""Property tests of the data cursor under churn, at the pure level (no network, no torch).

A model swarm drives the same pure functions the trainer uses (``pick_blocks``, ``SwarmView.leased``,
``decide_claims``, ``decide_commit``, ``step_target``, ``DataCursor.apply``) through any sequence of joins,
crashes, graceful leaves, pauses resumed on another number of peers, clock ticks, stale views (so claims overlap), forged claims, abandoned rounds
(a reducer failure) and rounds whose commit some participants miss (so the swarm forks and heals by
re-sync). Every state keeps its own ledger of which blocks its lineage of commits applied, counted
outside the cursor; the invariants:

- in every lineage each block of a data epoch is applied at most once, and exactly once when the epoch
  closes; the cursor agrees with the ledger and reports ``blocks_skipped == blocks_duplicated == 0``;
- an abandoned round applies none of its blocks;
- a lease of a dead peer blocks progress no longer than its report's expiry: when live peers cannot make a
  step, every free block they wait for is leased in a dead peer's unexpired report (or that report still
  counts as a live trainer the group must be a majority of), and once every dead peer's report has expired
  they finish the data epoch without waiting on the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.plan import pick_blocks
from swarmrun.protocol.round import (
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
    step_target,
)



SPEC_HASH = "ab" * 32
TTL = 8.0  # a progress report expires this long after it was stored (TrainerConfig.report_ttl)


@dataclass(eq=False)
class Lineage:
    """A state: its step, its cursor and, outside the cursor, how often its commits applied each block."""

    step: int
    cursor: DataCursor
    ledger: dict[int, dict[int, int]] = field(default_factory=dict)  # data epoch -> block -> times applied


@dataclass(eq=False)
class Peer:
    name: str
    batch_size: int
    state: Lineage
    claimed: RangeSet = RangeSet()
    samples: int = 0
    alive: bool = True

    def zero(self) -> None:
        self.claimed, self.samples = RangeSet(), 0


class SwarmModel(RuleBasedStateMachine):
    """The swarm as the trainer sees it: peers, their reports in a DHT that expires them, rounds."""

    @initialize(num_examples=st.integers(1, 70), block_size=st.integers(1, 6), target_batch=st.integers(1, 40),
                seed=st.integers(0, 2**32), batch_size=st.integers(1, 20))
    def start(self, num_examples, block_size, target_batch, seed, batch_size):
        self.target = target_batch
        self.now = 0.0
        self.dht: dict[str, tuple[ProgressReport, float]] = {}  # peer -> (report, expires at)
        self.peers: list[Peer] = []
        first = Lineage(0, DataCursor.new(seed=seed, num_examples=num_examples, block_size=block_size))
        self._add_peer(batch_size, first)

    # ---- helpers --------------------------------------------------------------------------------------
    def _add_peer(self, batch_size: int, state: Lineage) -> Peer:
        peer = Peer(f"p{len(self.peers):02d}", batch_size, state)
        self.peers.append(peer)
        self._publish(peer)
        return peer

    def _publish(self, peer: Peer, *, release: bool = False) -> None:
        s = peer.state
        report = ProgressReport(step=s.step, samples=0 if release else peer.samples, samples_per_second=1.0,
                                role=Role.TRAINER, state_hash=str(id(s)), time=self.now,
                                claimed=RangeSet() if release else peer.claimed, data_epoch=s.cursor.data_epoch,
                                cursor=s.cursor.summary())
        self.dht[peer.name] = (report, self.now + TTL)

    def _view(self) -> SwarmView:
        """What a DHT read returns now: the reports that have not expired."""
        return SwarmView(reports={p: r for p, (r, expires) in self.dht.items() if expires > self.now})

    def _alive(self) -> list[Peer]:
        return [p for p in self.peers if p.alive]

    def _newest(self) -> Lineage:
        """The newest state of the live peers; with none, of all peers (a paused run's snapshot)."""
        return max((p.state for p in self._alive() or self.peers), key=lambda s: s.step)

    def _all_states(self) -> list[Lineage]:
        return list({id(p.state): p.state for p in self.peers}.values())

    def _resync_if_behind(self, peer: Peer) -> None:
        newest = self._newest()
        if newest.step > peer.state.step:
            peer.state = newest  # a re-sync drops the local accumulation
            peer.zero()

    def _compute(self, peer: Peer, *, stale: bool) -> int:
        """The trainer's ``_take_blocks`` + ``_compute_once``; a stale view sees no lease and no other member."""
        self._resync_if_behind(peer)
        cursor = peer.state.cursor
        view = self._view()
        if stale:
            leased, members = RangeSet(), [peer.name]
        else:
            leased = view.leased(me=peer.name, step=peer.state.step, data_epoch=cursor.data_epoch)
            members = sorted(set(view.trainers) | {peer.name})
        count = max(1, math.ceil(peer.batch_size / cursor.block_size))
        blocks = pick_blocks(cursor, count, member=members.index(peer.name), members=len(members),
                             exclude=peer.claimed.add(leased))
        assert not set(blocks) & set(cursor.applied), "picked an applied block"
        assert not set(blocks) & set(peer.claimed), "picked a block it already holds"
        if not stale:
            assert not set(blocks) & set(leased), "picked a block another live trainer leases"
        picked = RangeSet.from_items(blocks)
        peer.claimed = peer.claimed.add(picked)
        peer.samples += claim_samples(picked, cursor)
        self._publish(peer)
        return len(blocks)

    def _round(self, group: list[Peer], *, fail: bool, missed: set[str], forged: list[RoundMeta]) -> tuple[bool, int]:
        """One round of peers sharing a state; returns whether it committed and how many claims it refused."""
        state = group[0].state
        assert all(p.state is state for p in group)
        metas = [RoundMeta(spec_hash=SPEC_HASH, step=state.step, samples=p.samples, blocks=p.claimed,
                           data_epoch=state.cursor.data_epoch) for p in group]
        order = list(range(len(group)))
        for i, meta in enumerate(forged):  # strangers' claims (stale or lying) among the gathered metadata
            metas.insert(i * 2 % (len(metas) + 1), meta)
            order.insert(i * 2 % (len(order) + 1), -1)
        target = step_target(state.cursor, self.target)
        claims = decide_claims(metas, state.cursor, target=target, tolerance=0.05)
        # the accepted claims are disjoint, fresh and weighed by what their blocks hold; the step keeps within its
        # size bounds whenever some subset of the valid claims can
        accepted = [m for i, m in enumerate(metas) if i not in claims.refused and i not in claims.excess]
        assert not set(claims.refused) & set(claims.excess)
        if claims.excess:
            event("a valid claim left out to keep the step's size")
            assert claims.samples <= max(target, int(target * 1.05))
        assert sum(len(m.blocks) for m in accepted) == len(claims.applied)
        assert all(m.data_epoch == state.cursor.data_epoch for m in accepted)  # claimed in this epoch's order
        assert not claims.applied.intersect(state.cursor.applied)
        assert claims.samples == claim_samples(claims.applied, state.cursor)
        names = [group[i].name for i in order if i >= 0]
        mine = Vote(step=state.step, group_id="aa", grad_hash="g", ok=not fail, reason="reducer failed" if fail else "")
        votes = {n: mine for n in names}
        live = max(len(self._view().trainers), len(names))
        decision = decide_commit(mine=mine, votes=votes, group=names, live_trainers=live, samples=claims.samples,
                                 target_batch_size=target, tolerance=0.05)
        if fail:
            assert isinstance(decision, Abandon)
            event("a round abandoned after a reducer failure")
        if claims.refused:
            event("a claim refused (overlapping, stale or lying)")
        refused_names = {group[k].name for j, k in enumerate(order) if k >= 0 and j in claims.refused}
        if not isinstance(decision, Commit):
            for p in group:  # nobody steps; a refused participant drops its gradients, the others keep them
                if p.name in refused_names:
                    p.zero()
                    self._publish(p)
            return False, len(claims.refused)
        new = Lineage(state.step + 1, state.cursor.apply(claims.applied),
                      {e: dict(blocks) for e, blocks in state.ledger.items()})
        counts = new.ledger.setdefault(state.cursor.data_epoch, {})
        for b in claims.applied:
            counts[b] = counts.get(b, 0) + 1
        if new.cursor.data_epoch > state.cursor.data_epoch:  # the epoch closed: every block exactly once
            event("a data epoch closed")
            assert sorted(counts) == list(range(state.cursor.num_blocks)) and set(counts.values()) == {1}
            assert new.cursor.history[-1] == {"epoch": state.cursor.data_epoch, "applied": state.cursor.num_blocks,
                                              "skipped": 0, "duplicated": 0}
        committers = [p for p in group if p.name not in missed] or group[:1]
        if len(committers) < len(group):
            event("a commit some participants missed (a fork)")
        for p in committers:  # the others timed out on the vote: they keep their step and gradients
            p.state = new
            p.zero()
            self._publish(p)
        return True, len(claims.refused)

    # ---- rules ----------------------------------------------------------------------------------------
    @rule(batch_size=st.integers(1, 20))
    def join(self, batch_size):
        if len(self.peers) < 8:
            self._add_peer(batch_size, self._newest())

    @precondition(lambda self: len(self._alive()) > 0)
    @rule(data=st.data(), graceful=st.booleans())
    def leave(self, data, graceful):
        peer = data.draw(st.sampled_from(self._alive()))
        if graceful:  # the last report releases its blocks (the trainer's final report)
            self._publish(peer, release=True)
        peer.alive = False  # a crash leaves its last report, and its lease, in the DHT until it expires

    @rule(batch_sizes=st.lists(st.integers(1, 20), min_size=1, max_size=3))
    def pause_and_resume(self, batch_sizes):
        """Every peer leaves (a pause); the run resumes from its newest state on another number of peers."""
        newest = self._newest()
        for p in self._alive():
            self._publish(p, release=True)
            p.alive = False
        self._tick(TTL)
        for batch_size in batch_sizes:
            if len(self.peers) < 12:
                self._add_peer(batch_size, newest)

    @rule(dt=st.floats(0.1, 6.0))
    def tick(self, dt):
        self._tick(dt)

    def _tick(self, dt: float) -> None:
        """Time passes; every live peer keeps its report fresh (the trainer republishes every 0.5 s)."""
        self.now += dt
        for p in self._alive():
            self._publish(p)

    @precondition(lambda self: len(self._alive()) > 0)
    @rule(data=st.data(), stale=st.booleans())
    def compute(self, data, stale):
        self._compute(data.draw(st.sampled_from(self._alive())), stale=stale)

    @precondition(lambda self: len(self._alive()) > 0)
    @rule(data=st.data(), fail=st.booleans(), n_forged=st.integers(0, 2))
    def round(self, data, fail, n_forged):
        alive = self._alive()
        anchor = data.draw(st.sampled_from(alive))
        peers = [p for p in alive if p.state is anchor.state]
        group = data.draw(st.lists(st.sampled_from(peers), min_size=1, unique_by=lambda p: p.name))
        group = data.draw(st.permutations(group))  # the gathered order
        missed = set(data.draw(st.lists(st.sampled_from([p.name for p in group]), unique=True)))
        cursor = anchor.state.cursor
        forged = []
        for _ in range(n_forged):
            blocks = RangeSet.from_items(data.draw(st.sets(st.integers(0, cursor.num_blocks - 1), max_size=4)))
            honest = claim_samples(blocks, cursor)
            forged.append(RoundMeta(spec_hash=SPEC_HASH, step=anchor.state.step,
                                    samples=data.draw(st.sampled_from([honest, honest + 1])), blocks=blocks,
                                    data_epoch=cursor.data_epoch + data.draw(st.sampled_from([0, 0, 1]))))
        before = {id(p): (p.state, p.state.cursor) for p in group}
        committed, _ = self._round(group, fail=fail, missed=missed, forged=forged)
        if not committed:  # an abandoned round applies none of its blocks
            assert all(p.state is before[id(p)][0] and p.state.cursor == before[id(p)][1] for p in group)

    # ---- invariants -----------------------------------------------------------------------------------
    @invariant()
    def every_block_at_most_once(self):
        if not hasattr(self, "peers"):
            return
        for s in self._all_states():
            for epoch, counts in s.ledger.items():
                assert max(counts.values(), default=0) <= 1, (epoch, counts)
            current = s.ledger.get(s.cursor.data_epoch, {})
            assert set(s.cursor.applied) == {b for b, c in current.items() if c}
            summary = s.cursor.summary()
            assert summary["blocks_skipped"] == 0 and summary["blocks_duplicated"] == 0
            assert summary["blocks_applied"] == sum(sum(c.values()) for c in s.ledger.values())
            assert summary["blocks_pending"] == len(s.cursor.pending())

    @invariant()
    def claims_never_hold_applied_blocks(self):
        if not hasattr(self, "peers"):
            return
        for p in self._alive():
            assert not p.claimed.intersect(p.state.cursor.applied)

    def _check_only_dead_reports_hold_back(self, group: list[Peer], dead_expiry: float) -> None:
        """Live peers that could not make a step wait only on what dead peers' unexpired reports hold: leases
        on blocks, or a place among the live trainers a group must be a majority of."""
        assert self.now < dead_expiry, "the live peers stall with no dead peer's report left to wait for"
        view = self._view()
        state = group[0].state
        if len(group) < len(view.trainers) // 2 + 1:
            return  # the dead peers' reports still count as live trainers: the group is not a majority yet
        held = RangeSet()
        for p in group:
            held = held.add(p.claimed)
        dead_leased = RangeSet()
        for name, r in view.reports.items():
            if not next(p for p in self.peers if p.name == name).alive and r.step == state.step:
                dead_leased = dead_leased.add(r.claimed)
        free = state.cursor.pending().subtract(held)
        assert not free.subtract(dead_leased), f"blocks {free.subtract(dead_leased).to_list()} wait with no lease"

    def teardown(self):
        """Drain: live peers (one joins if none is left) must close the current data epoch, waiting on the
        clock only until the reports of dead peers (and their leases) have expired."""
        if not hasattr(self, "peers"):
            return
        if not self._alive():
            self._add_peer(8, self._newest())
        start = self._newest()
        epoch, t0 = start.cursor.data_epoch, self.now
        dead_expiry = max((expires for name, (_, expires) in self.dht.items()
                           if not next(p for p in self.peers if p.name == name).alive), default=t0)
        for _ in range(10 * start.cursor.num_blocks + 50):
            newest = self._newest()
            if newest.cursor.data_epoch > epoch or newest.step > start.step + start.cursor.num_blocks + 2:
                break
            for p in self._alive():  # a fork heals by re-sync to one state (should_resync's majority rule)
                if p.state is not newest:
                    p.state = newest
                    p.zero()
                    self._publish(p)
            group = self._alive()
            # each live peer computes until the group holds a step's samples or no free block is left to it
            while sum(p.samples for p in group) < step_target(newest.cursor, self.target):
                if not sum(self._compute(p, stale=False) for p in group):
                    break
            committed, refused = self._round(group, fail=False, missed=set(), forged=[])
            if not committed and not refused:  # (a refused claim was dropped: retry at once)
                self._check_only_dead_reports_hold_back(group, dead_expiry)
                event("the drain waited on a dead peer's report")
                self._tick(0.5)
        newest = self._newest()
        assert newest.cursor.data_epoch == epoch + 1, "the data epoch did not close"
        assert self.now <= max(t0, dead_expiry) + 0.5
        # every block of every closed epoch of this lineage applied exactly once
        for e in range(newest.cursor.data_epoch):
            assert sorted(newest.ledger[e]) == list(range(newest.cursor.num_blocks))
            assert set(newest.ledger[e].values()) == {1}
        summary = newest.cursor.summary()
        assert summary["blocks_skipped"] == 0 and summary["blocks_duplicated"] == 0


SwarmModel.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestSwarmModel = SwarmModel.TestCase


def test_dead_lease_is_free_after_expiry():
    """A crashed peer's leased blocks are avoided while its report lives and taken as soon as it expires."""
    cursor = DataCursor.new(seed=1, num_examples=4 * 8, block_size=8)
    dead = ProgressReport(step=0, samples=16, samples_per_second=1.0, role=Role.TRAINER, state_hash="h", time=0.0,
                          claimed=RangeSet.from_items([0, 1]))
    me = ProgressReport(step=0, samples=16, samples_per_second=1.0, role=Role.TRAINER, state_hash="h", time=0.0,
                        claimed=RangeSet.from_items([2, 3]))
    dht = {"dead": (dead, TTL), "me": (me, 100.0)}

    def picks(now):
        view = SwarmView(reports={p: r for p, (r, exp) in dht.items() if exp > now})
        leased = view.leased(me="me", step=0, data_epoch=0)
        members = sorted(set(view.trainers) | {"me"})
        return pick_blocks(cursor, 4, member=members.index("me"), members=len(members),
                           exclude=me.claimed.add(leased))

    assert picks(TTL - 0.1) == []  # every other block is leased: wait
    assert sorted(picks(TTL)) == [0, 1]  # expired: the dead peer's blocks are free again


def test_forged_and_overlapping_claims_never_duplicate():
    """Two peers that did not see each other's leases claim the same blocks: only the first keeps them."""
    cursor = DataCursor.new(seed=2, num_examples=40, block_size=8)
    a = pick_blocks(cursor, 3, member=0, members=1, exclude=RangeSet())
    b = pick_blocks(cursor, 2, member=0, members=1, exclude=RangeSet())
    assert set(a) & set(b)
    metas = [RoundMeta(spec_hash=SPEC_HASH, step=0, samples=claim_samples(RangeSet.from_items(x), cursor),
                       blocks=RangeSet.from_items(x), data_epoch=0) for x in (b, a)]
    claims = decide_claims(metas, cursor)
    assert claims.refused == (1,) and set(claims.applied) == set(b)
    after = cursor.apply(claims.applied)
    again = decide_claims(metas[1:], after)  # the refused claim, retried on the new state, is refused again
    assert again.refused == (0,) and again.applied.is_empty
    assert after.summary()["blocks_duplicated"] == 0


def test_step_target_short_only_at_epoch_end():
    cursor = DataCursor.new(seed=3, num_examples=100, block_size=8)  # 13 blocks, the last holds 4
    assert step_target(cursor, 64) == 64
    near_end = cursor.apply(RangeSet.from_range(0, 10))  # 8 + 8 + 4 = 20 samples left
    assert step_target(near_end, 64) == 20 and step_target(near_end, 16) == 16
