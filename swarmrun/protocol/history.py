"""Which history a peer follows: the swarm's newest step, a fork healed by the majority at a step, and a split's
reunion (the history holding the newest majority commit, its *anchor*, wins; see ``should_resync``).

A split: peers that cannot see each other (a partition; from inside, a crash looks the same) each go on stepping
with what they see. A round advances its history's anchor only when it holds a majority of the run's membership
as its members remember it (``round.majority_round``: live trainers and those that vanished without saying they
left, lately), so while a partition lasts at most one side advances it. When the sides meet again, each peer
compares anchors: a history whose newest majority commit is older than another's, at a step at or past that
commit, lost; its peers re-sync to the winner's state, even at an older step, and count the steps they discard.

Evidence, not inference, decides that a peer's own history lost: its ``Ledger`` (the state it held after each step
since it adopted its lineage) must hold another state at the winning anchor's step. An anchor that lags (a state
fetched from a provider whose record was a step old) then never makes a peer of the winning history re-sync: its
ledger holds the anchor's state, and it takes the anchor on (``ServedState.hold_anchor``). And an anchor counts
as the swarm's newest only when two live reports carry it (a peer's own report counts once): one peer, a liar or
a confused one, cannot make the others discard their history.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from swarmrun.protocol.round import Anchor, SwarmView

#: steps of its own history a peer remembers the state of (about 100 bytes each). A side of a split that committed
#: more than this many steps since it adopted its lineage has no evidence left at the winning anchor's step: it
#: trusts the anchors alone (``outranked_here``)
MAX_LEDGER = 100_000


class Ledger:
    """This peer's own history: the state_hash it held after each step since it adopted its lineage (created or
    resumed the run, or fetched a state), the newest ``MAX_LEDGER`` of them."""

    def __init__(self) -> None:
        self.hashes: dict[int, str] = {}
        self.truncated = False  # older steps of this lineage were dropped

    @property
    def newest(self) -> int:
        return next(reversed(self.hashes), -1)

    def reset(self, step: int, state_hash: str) -> None:
        self.hashes, self.truncated = {step: state_hash}, False

    def add(self, step: int, state_hash: str) -> None:
        self.hashes[step] = state_hash  # steps only grow within a lineage (``ServedState.refresh``)
        if len(self.hashes) > MAX_LEDGER:
            del self.hashes[next(iter(self.hashes))]
            self.truncated = True

    def holds(self, anchor: Anchor) -> Optional[bool]:
        """Whether this history went through ``anchor``'s state; None if the ledger has no state at its step."""
        state_hash = self.hashes.get(anchor[0])
        return None if state_hash is None else state_hash == anchor[1]


def run_accounting(view: SwarmView) -> Optional[dict[str, int]]:
    """The run's data accounting as its live peers report it: the cursor summary of the newest step, from a
    peer holding the state most trainers at that step hold; None if no peer at that step reports one."""
    step = view.newest_step
    wanted = preferred_hash(view, step=step)
    candidates = sorted((p, r) for p, r in view.reports.items() if r.step == step and r.cursor is not None)
    ranked = sorted(candidates, key=lambda pr: (pr[1].state_hash != wanted, pr[0]))
    return dict(ranked[0][1].cursor) if ranked else None


def best_anchor(view: SwarmView) -> Optional[Anchor]:
    """The newest majority commit the swarm knows of: the newest anchor that two live reports or more back (a peer's
    own report counts once). A report backs its own anchor and every anchor at an older step: the members of a
    majority that steps faster than reports travel carry anchors a step or two apart (each report was written after
    another commit), and counting only equal anchors found none backed twice, so the reunion fell back to "the newest
    step wins" and a pair that had stepped as the majority re-synced to the lone side that had outstepped it after
    the heal, its own steps lost and not counted (the split trace's test: 2 runs of 2 on 7 Dec 2026). One report alone
    (a liar's, or one that lags) never decides: with a peer's own anchor as a second voice, both sides of a 1-1
    reunion ignored each other forever; a second anchor at the same step is no backing (a liar's hash at the
    majority's step), and a lone far-newer anchor backs older ones but is not backed itself (a liar's can only make
    an anchor that some other report carries the best, never one of its own)."""
    anchors = Counter(r.anchor for r in view.reports.values() if r.anchor is not None)
    backed = [a for a, n in anchors.items() if n + sum(m for b, m in anchors.items() if b[0] > a[0]) >= 2]
    return max(backed, default=None)


def outranked(step: int, anchor: Optional[Anchor], best: Optional[Anchor]) -> bool:
    """Whether a history at ``step`` with ``anchor`` lost to the majority commit ``best``: it stands at or past
    ``best``'s step yet its newest majority commit is an older one, so it does not hold ``best`` (a history that did
    would carry it: a round's members, a replayed step record and a fetched state all pass the anchor on). An unknown
    anchor (None) is never outranked: without one a peer follows the old rule, the newest step wins. Two anchors at
    one step outrank neither (the rule at a step decides: an order of hashes is no evidence of a majority)."""
    return best is not None and anchor is not None and anchor[0] < best[0] and step >= best[0]


def outranked_here(step: int, anchor: Optional[Anchor], best: Optional[Anchor], ledger: Optional[Ledger]) -> bool:
    """Whether this peer's own history lost to ``best`` (``outranked``) on evidence: its ledger holds another state
    at ``best``'s step. No state there (a lineage adopted after that step): not outranked, unless the ledger dropped
    that far back (then the anchors alone decide). Without a ledger (a caller that keeps none) the anchors decide."""
    if not outranked(step, anchor, best):
        return False
    held = ledger.holds(best) if ledger is not None else False
    return ledger.truncated if held is None else not held


def trusted_view(view: SwarmView, *, best: Optional[Anchor]) -> SwarmView:
    """The reports of peers whose history is not outranked (who a peer may follow, count or fetch from)."""
    return SwarmView(reports={p: r for p, r in view.reports.items() if not outranked(r.step, r.anchor, best)})


def should_resync(view: SwarmView, *, me: str, step: int, state_hash: str, anchor: Optional[Anchor] = None,
                  ledger: Optional[Ledger] = None) -> bool:
    """Whether this peer must fetch the swarm's state.

    The reunion rule of a split (two sides that each committed steps while they could not see each other): the
    history holding the newest majority commit (``best_anchor``) wins, and a peer whose history is outranked by it
    re-syncs to it even when it stands at a newer step (its own steps since are discarded, and counted). Otherwise:
    a trainer of a history that is not outranked is ahead of it, or at its step those trainers disagree with its
    state and outnumber those that agree (ties go to the smaller hash), which heals a split that a lost view of the
    swarm could cause."""
    best = best_anchor(view)
    if outranked_here(step, anchor, best, ledger):
        return True
    others = {p: r for p, r in trusted_view(view, best=best).trainers.items() if p != me}
    if any(r.step > step for r in others.values()):
        return True
    counts: dict[str, int] = {state_hash: 1}
    for r in others.values():
        if r.step == step:
            counts[r.state_hash] = counts.get(r.state_hash, 0) + 1
    best_hash = min(counts, key=lambda h: (-counts[h], h))
    return best_hash != state_hash


def preferred_hash(view: SwarmView, *, step: int, me: str = "") -> Optional[str]:
    """The state_hash most other trainers at ``step`` report (ties to the smaller hash); None if none does."""
    counts: dict[str, int] = {}
    for p, r in view.trainers.items():
        if p != me and r.step == step:
            counts[r.state_hash] = counts.get(r.state_hash, 0) + 1
    return min(counts, key=lambda h: (-counts[h], h)) if counts else None
