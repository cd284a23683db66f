"""The step plan, sans-IO: how many samples each trainer brings to a step, and when it enters the round.

A step carries ``target`` samples (``round.step_target``). The live trainers split it in proportion to their
reported speeds, in whole blocks (largest remainder, ties to the smaller peer id), so that they finish their parts
together and the step is the size it was asked to be. The members of a committed round plan the next step with the
speeds gathered in that round (``RoundMeta.rate``: the same numbers on each of them, so the same plan), not with
their own views (a report is read every ``report_interval`` or more, a step may take less: two members that planned with
different speeds brought parts that left the step short, and the round was abandoned; the links benchmark saw it in
most rounds). Each trainer publishes its part (``ProgressReport.quota``);
where the published parts of the others leave the step short (their views differed a moment), the first member
takes the rest, and where they overshoot the last member gives back what it has not computed yet. A trainer enters
matchmaking as soon as its part is computed, with the time the slowest member should finish (``round_eta``): its
group forms while the others compute, and the all-reduce starts when the last part is done.

Every function here reads only a ``SwarmView`` and numbers: the same on every peer that sees the same reports.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional

from swarmrun.protocol.cursor import DataCursor, RangeSet, block_order
from swarmrun.protocol.round import ProgressReport, SwarmView


class Speed:
    """A trainer's speed (samples per second of forward and backward), pooled (samples / seconds) over whole parts:
    the current one and as many of the last ones as make at least ``MIN_BATCHES`` batches.

    Not an average of its last batches: peers that share a machine's cores (or a link, a disk) compute faster once
    the others' parts are done, so the last batches of the peer that finishes last are its fastest. Planned by
    those, it got the largest part of the next step and finished last again: on links.py's 4 peers on 2 cores (7
    Dec, outer mode) parts of one step ranged 14,720 to 35,920 samples while each peer computed ~2,400-2,800
    samples/s over its part, and two peers idled ~45% of every step. Pooled over whole parts, speeds measured under
    the same contention lead to parts that finish together.

    And not over one part only: where many peers share a small target a part is a batch or two, and one stalled
    batch (8 peers on 2 cores) became the whole speed; the plan gave that peer no block, so it computed nothing and
    its speed never changed again (churn8 at efe4eba: one peer computed in 11 of its 142 steps, 131 re-syncs in
    the run against 15 before)."""

    MIN_BATCHES = 16
    KEEP_PARTS = 64

    def __init__(self):
        self._parts: collections.deque = collections.deque(maxlen=self.KEEP_PARTS)  # closed: (samples, s, batches)
        self._now = (0, 0.0, 0)  # the current part

    def add(self, samples: int, seconds: float) -> float:
        """Count a computed batch in; the speed now."""
        n, dt, b = self._now
        self._now = (n + samples, dt + max(0.0, seconds), b + 1)
        return self.value

    def close(self) -> None:
        """The current part ended (committed, dropped); one with nothing computed leaves no trace."""
        if self._now[0] > 0:
            self._parts.append(self._now)
            self._now = (0, 0.0, 0)

    @property
    def value(self) -> float:
        n, dt, b = self._now
        for pn, pdt, pb in reversed(self._parts):
            if b >= self.MIN_BATCHES:
                break
            n, dt, b = n + pn, dt + pdt, b + pb
        return n / dt if dt > 0 else 0.0


@dataclass(frozen=True)
class StepPlan:
    """Samples per member for one step (members: sorted peer ids of the trainers taking part)."""

    target: int
    quotas: Mapping[str, int]

    @property
    def members(self) -> list[str]:
        return sorted(self.quotas)


#: samples per second a plan believes at most (a report or a round's rate beyond it is a lie or a unit error; one
#: such number must not overflow the plan of every member)
MAX_RATE = 1e9

#: a trainer this many steps behind still counts in a step's plan: its report may be older than the steps of a fast
#: swarm (reports are read every report_interval); one further behind is re-syncing and joins the plan after
PLAN_LAG = 2


def plan_members(view: SwarmView, *, me: str, step: int, since: float = float("inf"),
                 group: Optional[Collection[str]] = None) -> dict[str, ProgressReport]:
    """The trainers a step is planned with, not leaving; this peer always.

    ``group``: the members of the round that committed this step, known to be at it whatever their reports say
    yet; with it, the others count only once their report shows this step. A trainer that was not in that round is
    behind (it re-syncs): waiting for its part shut it out for good in the links benchmark (the group assembled
    without it, short by its part, at every step). Without a group (this peer re-synced, joined or started), the
    live trainers at this step or up to ``PLAN_LAG`` behind (their commits are on their way: their report is a
    moment old); one behind whose report was written after ``since`` (the DHT time this peer reached ``step``) is
    behind indeed: it is not waited for. A trainer that asked to be planned in a step (``ProgressReport.joining``:
    it was left out of rounds that formed before its report was read) is a member of that step only, wherever it is
    now: it waits there, and it must not be waited for before."""
    def member(p: str, r: ProgressReport) -> bool:
        if p == me:
            return True
        if r.left or r.finished or r.step > step:
            return False
        if r.joining is not None:
            return r.joining == step
        if group is not None:
            return p in group or r.step == step
        return r.step >= step - PLAN_LAG and (r.step == step or r.time < since)

    return {p: r for p, r in view.trainers.items() if member(p, r)}


def plan_step(view: SwarmView, *, me: str, step: int, my_rate: float, target: int, block_size: int,
              since: float = float("inf"), agreed: Mapping[str, float] = {}) -> StepPlan:
    """Split ``target`` among the members by speed, in blocks of ``block_size``.

    ``agreed``: the members of the round that committed this step and the speeds it gathered (this peer's among
    them; 0 for one that had none yet): the plan's members (``plan_members``' group), and their speeds before the
    view's and ``my_rate``. A member that reports no speed yet (it just joined) counts at
    the mean speed of the others, or 1 if none is known. The last part is trimmed so that the parts add up to
    exactly ``target`` samples.
    """
    members = plan_members(view, me=me, step=step, since=since, group=set(agreed) if agreed else None)
    rates = {p: (my_rate if p == me else r.samples_per_second) for p, r in members.items()}
    rates.setdefault(me, my_rate)
    # a member of the round whose report this peer has not read (yet, or any more) is a member all the same: the
    # others plan with it (one that said it left is out, by its report, on every peer that read it)
    rates |= {p: 0.0 for p in agreed if p not in view.reports}
    rates = {p: min(MAX_RATE, agreed[p] if p in agreed else v) for p, v in rates.items()}
    known = [v for v in rates.values() if v > 0]
    fill = sum(known) / len(known) if known else 1.0
    rates = {p: (v if v > 0 else fill) for p, v in rates.items()}
    total = sum(rates.values())
    blocks = math.ceil(target / block_size)
    raw = {p: blocks * rates[p] / total for p in sorted(rates)}
    counts = {p: math.floor(x) for p, x in raw.items()}
    left = blocks - sum(counts.values())
    for p in sorted(raw, key=lambda p: (-(raw[p] - counts[p]), p))[:left]:
        counts[p] += 1
    quotas = {p: c * block_size for p, c in counts.items()}
    over = sum(quotas.values()) - target
    for p in sorted(quotas, reverse=True):  # whole blocks overshoot a target that is not a multiple of them
        cut = min(over, quotas[p])
        quotas[p] -= cut
        over -= cut
    return StepPlan(target=target, quotas=quotas)


def my_quota(plan: StepPlan, view: SwarmView, *, me: str, step: int, samples: int) -> int:
    """This trainer's part, reconciled with what the others published for this step.

    A member at this step that published its part counts with it (or with what it already computed, if more: work
    carried into the step, ``outer_overlap``, before it published one); one not yet at this step counts with its part
    of this plan. A shortfall goes to the first member, a surplus comes off the last one's part (never below what it
    computed already). And no part reaches past what the
    others at this step already computed: a trainer that joined while one of them held most of the step (its
    partner killed, its plan's surplus on a member that is gone) brought its whole part on top, and the step carried
    272 samples for 256 (CI's outer trace). Computed samples are brought to the round; should their peer die, the
    round falls short and its first member computes the rest.
    """
    mine = plan.quotas.get(me, 0)
    planned = dict(plan.quotas)
    for p in plan.members:
        r = view.trainers.get(p)
        if p != me and r is not None and r.step == step:  # (no part published yet: work carried into the step)
            planned[p] = max(planned[p] if r.quota is None else r.quota, r.samples)
    planned[me] = max(mine, samples)
    gap = plan.target - sum(planned.values())
    if gap > 0 and me == plan.members[0]:
        mine += gap
    elif gap < 0 and me == plan.members[-1]:
        mine = max(samples, mine + gap)
    computed = sum(r.samples for p, r in view.trainers.items() if p != me and r.step == step and not r.left)
    return min(mine, max(samples, plan.target - computed))


def others_planned(view: SwarmView, *, me: str, step: int) -> int:
    """Samples the other trainers at this step hold or plan to bring (their published parts)."""
    return sum(max(r.samples, r.quota or 0) for p, r in view.trainers.items() if p != me and r.step == step)


def ready_for_round(view: SwarmView, *, me: str, step: int, samples: int, quota: int, target: int) -> bool:
    """Enter matchmaking once this trainer's part is computed. With nothing to bring (no free block left to it),
    only when the others' parts make the step: it takes part with zero weight (weights are the claimed samples);
    without it, a peer holding every block left in a data epoch would wait for a group that never forms."""
    if samples <= 0:
        return others_planned(view, me=me, step=step) >= target
    return samples >= quota


def run_eta(steps_left: int, *, step_seconds: Optional[float], target: int, samples_per_second: float) -> Optional[float]:
    """Seconds until the run ends: the steps left at a step's mean wall time once known; before that, at the swarm's
    compute speed alone (an underestimate: rounds are not counted); None without either."""
    if step_seconds is not None:
        return steps_left * step_seconds
    return steps_left * target / samples_per_second if samples_per_second > 0 else None


def round_eta(plan: StepPlan, view: SwarmView, *, me: str, step: int) -> float:
    """Seconds until the slowest other member of the plan should have computed its part: what is left of its
    published part at its speed, or its whole part of this plan if it has not reached this step yet."""
    eta = 0.0
    for p in plan.members:
        r = view.trainers.get(p)
        if p == me or r is None or r.samples_per_second <= 0:
            continue
        if r.step == step and r.quota is not None:
            left = r.quota - r.samples
        else:
            left = plan.quotas.get(p, 0) - (r.samples if r.step == step else 0)
        eta = max(eta, left / r.samples_per_second)
    return eta


def shortfall_taker(group: list[str], *, me: str) -> bool:
    """Whether this peer computes what a round fell short by (known to every member from the gathered claims):
    the first member of the group, by peer id."""
    return bool(group) and me == min(group)


def inner_batch(quota: int, inner_steps: int) -> int:
    """Outer mode: the samples of one inner step of a trainer whose part of the step is ``quota``, so that it takes
    ``inner_steps`` inner steps per outer step whatever its part (a faster peer takes larger ones). At least 1."""
    return max(1, -(-max(0, quota) // max(1, inner_steps)))


def pick_blocks(cursor: DataCursor, count: int, *, member: int, members: int, exclude: RangeSet) -> list[int]:
    """Up to ``count`` unapplied blocks for trainer ``member`` of ``members`` (sorted peer ids).

    The epoch's data order (the same on every peer) is dealt round-robin into ``members`` hands once per data epoch,
    so a block stays in its member's hand from one step to the next. (Dealt anew from the unapplied blocks at every
    commit, hands shifted: blocks a member computed during a round for the next step, ``outer_overlap``, were in
    another member's hand after the commit, and links.py's claims collided at every step.) The member takes the
    unapplied blocks of its own hand first, from the front. Once its hand is spent (near an epoch's end, or when it is
    faster than its share), it takes from the *back* of the others' hands, the next member's first, so it meets a
    member still taking from the front of its own hand only when no block is left; the back of a hand is shared among
    the other members by position first (two members whose hands are spent, two fast ones of three, took the same
    blocks of the slow one's), then any free block is taken. ``exclude``: blocks held by this peer or leased by
    others."""
    hands = _hands(cursor.seed, cursor.data_epoch, cursor.num_blocks, cursor.applied.ranges, members)
    excluded = _mask(cursor.num_blocks, exclude.ranges)
    out = _free(hands[member], excluded, count)
    for shared in (True, False):
        for k in range(1, members):
            if len(out) >= count:  # (the usual case: no hand of another is walked)
                return out
            hand = hands[(member + k) % members]
            back = range(len(hand) - 1 - member, -1, -members) if shared else range(len(hand) - 1, -1, -1)
            out += _free((hand[i] for i in back), excluded, count - len(out))
    return out


def _free(blocks: Iterable[int], excluded: bytearray, count: int) -> list[int]:
    """The first ``count`` of ``blocks`` not ``excluded``; they are marked ``excluded`` as they are taken."""
    out: list[int] = []
    for b in blocks:
        if len(out) >= count:
            break
        if not excluded[b]:
            excluded[b] = 1
            out.append(b)
    return out


def _mask(n: int, ranges) -> bytearray:
    """One byte per block, 1 where ``ranges`` hold it (protocol/ stays stdlib: no numpy)."""
    mask = bytearray(n)
    for start, end in ranges:
        start, end = max(0, start), min(n, end)
        if end > start:
            mask[start:end] = b"\x01" * (end - start)
    return mask


@functools.lru_cache(maxsize=8)
def _hands(seed: int, data_epoch: int, num_blocks: int, applied: tuple, members: int) -> tuple[tuple[int, ...], ...]:
    """The data order dealt into ``members`` hands, less the applied blocks (once per state and membership: a dataset
    may hold millions of blocks)."""
    mask = _mask(num_blocks, applied)
    order = block_order(seed, data_epoch, num_blocks)
    return tuple(tuple(b for b in order[m::members] if not mask[b]) for m in range(max(1, members)))
