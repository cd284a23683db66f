"""The collective round, sans-IO: the metadata gathered in a round, progress reports, the commit vote.

A round is one attempt at a step: matchmaking, all-reduce, commit vote. Each participant sends a
``RoundMeta`` in hivemind's gathered metadata; every participant decides, from the same gathered list,
the same averaging weights and the same set of blocks the step applies (``decide_claims``). After the
all-reduce each participant publishes a ``Vote``; ``decide_commit`` commits only a complete round whose
votes agree and whose group holds a majority of the run's live trainers.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

from swarmrun.protocol.codec import bytes_field, float_field, int_field, message, pack, require, str_field, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet, block_examples
from swarmrun.protocol.errors import ProtocolError, Reject, Rejection
from swarmrun.protocol.spec import DEFAULT_STEP_TOLERANCE

ROUND_VERSION = 1
MAX_META_BYTES = 64 * 1024
MAX_REPORT_BYTES = 16 * 1024
#: (step, state_hash) of the newest step of a history that a majority round committed (``ProgressReport.anchor``)
Anchor = tuple[int, str]
MAX_LEASE_RANGES = 256
SUMMARY_KEYS = frozenset({"blocks_applied", "blocks_pending", "blocks_skipped", "blocks_duplicated", "data_epoch"})

#: a run's votes live in this many keys, a ring indexed by step: a finite set of keys is what lets a validator
#: recognise every one of them from its hashed DHT key (``protocol.records``); a key per step could be filled with
#: a stranger's plain values ahead of the swarm. A slot is reused after VOTE_SLOTS steps; its subkeys are
#: overwritten by their own writers, and readers keep only votes of their round's group.
VOTE_SLOTS = 256


# DHT keys of a run: every one is in the schema table ``protocol.records.RUN_KEYS``
def progress_key(run_id: str) -> str:
    """Subkey per peer: its ``ProgressReport``."""
    return f"swarmrun.{run_id}.progress"


def vote_key(run_id: str, step: int) -> str:
    """Subkey per peer: its ``Vote`` for the round that would make ``step`` -> ``step + 1`` (slot ``step`` mod
    ``VOTE_SLOTS``: the vote carries its step and group, and a reader keeps only its own round's)."""
    return f"swarmrun.{run_id}.vote.{step % VOTE_SLOTS}"


def spec_key(run_id: str) -> str:
    """The run's signed spec."""
    return f"swarmrun.{run_id}.spec"


class Role(str, enum.Enum):
    TRAINER = "trainer"
    KEEPER = "keeper"


@dataclass(frozen=True, kw_only=True)
class RoundMeta:
    """What one participant contributes to a round's gathered metadata."""

    spec_hash: str
    step: int  # the step the participant's state is at; the round makes step -> step + 1
    samples: int  # samples whose gradients the participant accumulated (its claimed blocks' examples)
    blocks: RangeSet  # the blocks it claims, of the cursor's current data epoch
    data_epoch: int
    grad_norm: float = 0.0  # declared norm of its contribution (admission refuses one far off the recent median)
    certificate: bytes = b""  # its invite certificate (an invite-only run admits it to the group only with one)
    ready_at: float = 0.0  # DHT time its part was computed (the last member's is when the step's target was reached)
    rate: float = 0.0  # its compute speed (samples/s): every member of a committed round plans the next step with these
    version: int = ROUND_VERSION

    def encode(self) -> bytes:
        return pack(
            dict(
                type="round_meta",
                version=self.version,
                spec_hash=self.spec_hash,
                step=self.step,
                samples=self.samples,
                blocks=self.blocks.to_list(),
                data_epoch=self.data_epoch,
                grad_norm=self.grad_norm,
                certificate=self.certificate,
                **({"ready_at": self.ready_at} if self.ready_at else {}),
                **({"rate": self.rate} if self.rate else {}),
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> "RoundMeta":
        d = message(data, "round_meta", ROUND_VERSION, max_size=MAX_META_BYTES)
        cert = d.get("certificate", b"")
        require(isinstance(cert, bytes), "certificate must be bytes")
        return cls(
            spec_hash=str_field(d, "spec_hash", 128),
            step=int_field(d, "step"),
            samples=int_field(d, "samples", 0, 2**40),
            blocks=RangeSet.from_list(d.get("blocks")),
            data_epoch=int_field(d, "data_epoch"),
            grad_norm=float_field(d, "grad_norm"),
            certificate=cert,
            ready_at=float_field(d, "ready_at") if "ready_at" in d else 0.0,
            rate=min(max(0.0, float_field(d, "rate")), 1e9) if "rate" in d else 0.0,
        )


def decode_gathered(blob: bytes) -> RoundMeta:
    """A member's ``RoundMeta`` as hivemind gathers it: msgpack ``[bandwidth, mode, user_bytes]``, whose
    user_bytes wrap ours."""
    outer = unpack(blob, max_size=128 * 1024)
    if not (isinstance(outer, list) and len(outer) == 3 and isinstance(outer[2], bytes)):
        raise ProtocolError("malformed gathered metadata")
    inner = unpack(outer[2], max_size=128 * 1024)
    if not isinstance(inner, bytes):
        raise ProtocolError("malformed gathered metadata")
    return RoundMeta.decode(inner)


def check_round_meta(meta: RoundMeta, *, spec_hash: str, step: int) -> Optional[Rejection]:
    """Admission of a participant into a round (before any tensor moves): same spec, same step."""
    if meta.spec_hash != spec_hash:
        return Rejection(Reject.WRONG_SPEC, f"spec hash {meta.spec_hash[:12]} != {spec_hash[:12]}")
    if meta.step != step:
        return Rejection(Reject.WRONG_STEP, f"participant is at step {meta.step}, this round is for step {step}")
    return None


@dataclass(frozen=True, kw_only=True)
class ClaimDecision:
    """The outcome of the claims of a round: identical on every participant."""

    weights: tuple[float, ...]  # averaging weight per participant (in gathered order): its samples, or 0
    applied: RangeSet  # the union of accepted claims: the blocks this step applies
    samples: int  # total samples of accepted claims
    refused: tuple[int, ...]  # indices of participants whose claims overlapped or were invalid (weight 0)
    excess: tuple[int, ...] = ()  # valid claims left out to keep the step within its size bounds (weight 0)


def step_target(cursor: DataCursor, target_batch_size: int) -> int:
    """Samples a step needs: ``target_batch_size``, or what is left of the data epoch when less is left (the
    epoch's last step is short rather than reaching into the next epoch's order)."""
    pending = cursor.pending()
    if len(pending) * cursor.block_size > target_batch_size + cursor.block_size:  # cheap: far from the epoch's end
        return target_batch_size
    return min(target_batch_size, claim_samples(pending, cursor))


def held_by_others(metas: Sequence[RoundMeta], peer_ids: Sequence[str], *, me: str,
                   refused: Collection[int] = ()) -> dict[str, RangeSet]:
    """The blocks each other member of a round holds gradients for, as its gathered claim says (a refused member
    drops its own): what this peer must not take again at that step. A report leases at most ``MAX_LEASE_RANGES``
    ranges, and a part computed alone before the others came can be thousands of scattered blocks (links.py, outer
    mode: the others took its unleased blocks, were refused round after round and the run died after 51)."""
    return {peer: meta.blocks for i, (peer, meta) in enumerate(zip(peer_ids, metas))
            if peer != me and i not in refused}


def claim_samples(blocks: RangeSet, cursor: DataCursor) -> int:
    """Number of examples in these blocks (the last block of the dataset may be short)."""
    return sum(len(block_examples(b, cursor.block_size, cursor.num_examples)) for b in blocks)


def _claim_valid(meta: RoundMeta, cursor: DataCursor) -> bool:
    if meta.data_epoch != cursor.data_epoch:
        return False
    if meta.blocks.is_empty:
        return meta.samples == 0
    if meta.blocks.ranges[0][0] < 0 or meta.blocks.ranges[-1][1] > cursor.num_blocks:
        return False
    if not meta.blocks.intersect(cursor.applied).is_empty:
        return False
    # the weight is what the claimed blocks hold, never a number the participant merely declares
    return meta.samples == claim_samples(meta.blocks, cursor)


def step_bounds(target: int, tolerance: float) -> tuple[int, int]:
    """The samples a committed step may carry: ``target`` within ``tolerance`` (a fraction; the spec's
    ``step_tolerance``, default ``DEFAULT_STEP_TOLERANCE``)."""
    return math.ceil(target * (1 - tolerance)), max(target, math.floor(target * (1 + tolerance)))


def decide_claims(metas: Sequence[RoundMeta], cursor: DataCursor, *, target: Optional[int] = None,
                  tolerance: float = DEFAULT_STEP_TOLERANCE) -> ClaimDecision:
    """Accept each participant's claim unless it overlaps an applied block or a claim accepted before it
    (in gathered order, so the first of two overlapping claims keeps its blocks).

    A claim from another data epoch than the cursor's, outside the dataset, or whose declared sample count
    differs from what its blocks hold, is refused as a whole. The weight of an accepted participant is the
    sample count of its blocks; a refused one contributes with weight 0.

    With a ``target``, the step carries at most ``target`` within ``tolerance``: the valid claims kept are the subset
    with the most samples under the upper bound (the first such subset in gathered order); the others are left out
    (``excess``; their blocks go back to the pool and are computed again at the next step's parameters, so a replay
    of the step records gives the same bits). If no subset reaches the lower bound, every valid claim is accepted
    instead: a larger step, never lost work.
    """
    valid = []
    applied = RangeSet()
    for i, meta in enumerate(metas):  # the gathered order is the same on every participant
        if _claim_valid(meta, cursor) and meta.blocks.intersect(applied).is_empty:
            valid.append(i)
            applied = applied.add(meta.blocks)
    accepted = valid
    if target is not None:
        low, high = step_bounds(target, tolerance)
        fits = _fullest_subset([metas[i].samples for i in valid], high)
        if sum(metas[valid[k]].samples for k in fits) >= low:
            accepted = [valid[k] for k in fits]
    chosen = set(accepted)
    weights = tuple(float(m.samples) if i in chosen else 0.0 for i, m in enumerate(metas))
    applied = RangeSet()
    for i in accepted:
        applied = applied.add(metas[i].blocks)
    return ClaimDecision(weights=weights, applied=applied, samples=sum(metas[i].samples for i in accepted),
                         refused=tuple(i for i in range(len(metas)) if i not in chosen and i not in valid),
                         excess=tuple(i for i in valid if i not in chosen))


def _fullest_subset(sizes: Sequence[int], high: int) -> list[int]:
    """Indices of the subset of ``sizes`` with the largest sum not above ``high``; among equal sums the one that is
    smallest in lexicographic order of indices (a subset-sum table over reachable sums: groups are small)."""
    best: dict[int, tuple[int, ...]] = {0: ()}
    for i, size in enumerate(sizes):
        for total, subset in sorted(best.items()):
            t = total + size
            if size > 0 and t <= high and (t not in best or subset + (i,) < best[t]):
                best[t] = subset + (i,)
    return list(best[max(best)])


@dataclass(frozen=True, kw_only=True)
class Vote:
    """A participant's report on a finished all-reduce: what it would commit."""

    step: int
    group_id: str  # hex
    grad_hash: str  # sha256 of the averaged gradient it holds
    ok: bool  # its all-reduce was complete (no failed reducer, no banned sender, finite average)
    reason: str = ""
    live: int = 0  # trainers this participant saw live recently: the group must be a majority of everyone's count
    # the run's membership as this participant remembers it (``Reporter.members``): live trainers and those that
    # vanished without saying they left, lately. A round that holds a majority of it advances the history's anchor
    members: int = 0

    def encode(self) -> bytes:
        extra = {"members": self.members} if self.members else {}
        return pack(dict(type="vote", version=ROUND_VERSION, step=self.step, group_id=self.group_id,
                         grad_hash=self.grad_hash, ok=self.ok, reason=self.reason[:200], live=self.live, **extra))

    @classmethod
    def decode(cls, data: bytes) -> "Vote":
        d = message(data, "vote", ROUND_VERSION, max_size=4096)
        require(isinstance(d.get("ok"), bool), "ok must be a bool")
        return cls(step=int_field(d, "step"), group_id=str_field(d, "group_id", 128), grad_hash=str_field(d, "grad_hash", 128),
                   ok=d["ok"], reason=str_field(d, "reason", 200), live=int_field(d, "live", 0, 1 << 20) if "live" in d else 0,
                   members=int_field(d, "members", 0, 1 << 20) if "members" in d else 0)


def round_votes(votes: Mapping[str, Vote], *, group: Sequence[str], group_id: str, step: int) -> dict[str, Vote]:
    """The votes that count in one round: cast by a member of its group (the signer of the vote's subkey is in
    ``group``) for this round (its group id and step). A stranger's vote, or one of an earlier attempt at the same
    step by another group, is not a vote here: it never ends a member's wait and never abandons the round.

    Args:
        votes: every signed vote read under the step's vote key, by the peer id that signed it.
        group: peer ids of the round's participants; group_id: the round's group id (hex).
    """
    members = set(group)
    return {p: v for p, v in votes.items() if p in members and v.group_id == group_id and v.step == step}


def vote_wait_over(*, mine: Vote, votes: Mapping[str, Vote], group: Sequence[str]) -> bool:
    """Whether a member may stop waiting for votes: its own is not ok, every member voted, or a member voted not ok.
    ``votes`` must already be ``round_votes`` (a stranger's ``ok=False`` must not end the wait)."""
    if not mine.ok or all(p in votes for p in group):
        return True
    return any(not v.ok for p, v in votes.items() if p in group)


@dataclass(frozen=True)
class Commit:
    # the round held a majority of the run's membership as its members remember it (``majority_round``): the step
    # becomes its history's anchor. Set by the round runner after ``decide_commit``
    majority: bool = True


@dataclass(frozen=True)
class Abandon:
    reason: str


def decide_commit(
    *,
    mine: Vote,
    votes: Mapping[str, Vote],
    group: Sequence[str],
    live_trainers: int,
    samples: int,
    target_batch_size: int,
    tolerance: float = 0.0,
) -> Commit | Abandon:
    """Commit iff every member of the group voted ok for the same (step, group, gradient), the group holds a
    majority of the live trainers, and the accepted samples reach the target batch size.

    Args:
        mine: this participant's vote.
        votes: the votes seen so far, by peer id (may include strangers: they are ignored).
        group: peer ids of the round's participants.
        live_trainers: trainers of the run with a live progress report (this peer included).
        samples: accepted samples of the round (``ClaimDecision.samples``).
        tolerance: the step may carry this fraction fewer than ``target_batch_size`` (``step_bounds``).
    """
    if not mine.ok:
        return Abandon(f"local all-reduce incomplete: {mine.reason}")
    missing = [p for p in group if p not in votes]
    if missing:
        return Abandon(f"{len(missing)} of {len(group)} participants did not vote")
    for peer in group:
        vote = votes[peer]
        if not vote.ok:
            return Abandon(f"participant {peer[-6:]} reports an incomplete all-reduce: {vote.reason}")
        if (vote.step, vote.group_id, vote.grad_hash) != (mine.step, mine.group_id, mine.grad_hash):
            return Abandon(f"participant {peer[-6:]} holds a different averaged gradient")
    # the largest count any member saw: two groups with partial views of the swarm cannot both be a majority
    live_trainers = max([live_trainers, *(votes[p].live for p in group)])
    if len(group) < live_trainers // 2 + 1:
        return Abandon(f"group of {len(group)} is not a majority of {live_trainers} live trainers")
    low, _ = step_bounds(target_batch_size, tolerance)
    if samples < low:
        return Abandon(f"round carries {samples} samples, fewer than target_batch_size={target_batch_size}"
                       + (f" less {tolerance:.0%}" if tolerance else ""))
    return Commit()


def majority_round(votes: Mapping[str, Vote], group: Sequence[str]) -> bool:
    """Whether a committed round held a majority of the run's membership as its members remember it (the largest
    ``members`` any member voted): only such a round advances its history's anchor. Every member computes it from
    the same votes, so the members of one round agree on it. A vote without ``members`` (a peer of an earlier
    build) counts its ``live``."""
    remembered = max([len(group), *(max(votes[p].members, votes[p].live) for p in group if p in votes)])
    return len(group) >= remembered // 2 + 1


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    """A peer's periodic report in the DHT: where it is, how fast it goes, what it can serve."""

    step: int
    samples: int  # samples accumulated towards the next step
    samples_per_second: float
    role: Role
    state_hash: str  # of its state at `step`
    time: float  # the reporter's DHT time
    maddrs: tuple[str, ...] = ()
    finished: bool = False  # the run reached total_steps
    # blocks whose gradients this peer holds for the next step: a lease, advice for others to avoid them
    # (the DHT has no compare-and-swap; the round decides, see decide_claims)
    claimed: RangeSet = RangeSet()
    data_epoch: int = 0
    # the reporter's data accounting at ``step`` (DataCursor.summary()); None from a peer that sends none
    cursor: Optional[Mapping[str, int]] = None
    certificate: bytes = b""  # the reporter's access certificate (invite-only runs)
    # the reporter has a snapshot store (--snapshot-to): it can be the run's elected snapshot writer
    snapshots: bool = False
    left: bool = False  # the reporter's last report: it stopped training (max_steps, a signal, a pause)
    # samples the reporter plans to bring to the step it is at (its part of the step plan, ``protocol.plan``)
    quota: Optional[int] = None
    # the step the reporter, a step or more behind, asks to be planned in (``protocol.plan``): a trainer left out
    # of rounds that form before its report is read (a fast swarm) waits there for the others' plan to hold it
    joining: Optional[int] = None
    # the newest step of the reporter's history that a majority round committed, (step, state_hash): which history
    # wins when two sides of a split meet again (``should_resync``). None: unknown (a joiner before its first
    # state, a peer of an earlier build)
    anchor: Optional[Anchor] = None

    def encode(self) -> bytes:
        extra = {"cursor": dict(self.cursor)} if self.cursor is not None else {}
        if self.anchor is not None:
            extra["anchor"] = list(self.anchor)
        if self.certificate:
            extra["certificate"] = self.certificate
        if self.snapshots:
            extra["snapshots"] = True
        if self.left:
            extra["left"] = True
        if self.quota is not None:
            extra["quota"] = self.quota
        if self.joining is not None:
            extra["joining"] = self.joining
        return pack(dict(type="progress", version=ROUND_VERSION, step=self.step, samples=self.samples,
                         sps=self.samples_per_second, role=self.role.value, state_hash=self.state_hash,
                         time=self.time, maddrs=list(self.maddrs[:8]), finished=self.finished,
                         claimed=self.claimed.to_list()[:MAX_LEASE_RANGES], data_epoch=self.data_epoch, **extra))

    @classmethod
    def decode(cls, data: bytes) -> "ProgressReport":
        d = message(data, "progress", ROUND_VERSION, max_size=MAX_REPORT_BYTES)
        maddrs = d.get("maddrs", [])
        require(isinstance(maddrs, list) and all(isinstance(m, str) and len(m) < 512 for m in maddrs), "maddrs")
        require(isinstance(d.get("role"), str) and d["role"] in {r.value for r in Role}, "role")
        require(isinstance(d.get("finished", False), bool), "finished")
        require(isinstance(d.get("snapshots", False), bool) and isinstance(d.get("left", False), bool), "flags")
        return cls(step=int_field(d, "step"), samples=int_field(d, "samples", 0, 2**40), samples_per_second=float_field(d, "sps"),
                   role=Role(d["role"]), state_hash=str_field(d, "state_hash", 128), time=float_field(d, "time"),
                   maddrs=tuple(maddrs), finished=d.get("finished", False),
                   claimed=RangeSet.from_list(d.get("claimed", [])), data_epoch=int_field(d, "data_epoch"),
                   cursor=_summary(d["cursor"]) if "cursor" in d else None,
                   certificate=bytes_field(d, "certificate", 8192) if "certificate" in d else b"",
                   snapshots=d.get("snapshots", False), left=d.get("left", False),
                   quota=int_field(d, "quota", 0, 2**40) if "quota" in d else None,
                   joining=int_field(d, "joining") if "joining" in d else None,
                   anchor=decode_anchor(d["anchor"]) if "anchor" in d else None)


def decode_anchor(value: object) -> Anchor:
    """An anchor received on the wire: ``[step, state_hash]``."""
    require(isinstance(value, list) and len(value) == 2, "anchor must be [step, state_hash]")
    return int_field({"s": value[0]}, "s"), str_field({"h": value[1]}, "h", 128)


def _summary(d: object) -> dict[str, int]:
    """A cursor summary received in a progress report: the keys of ``DataCursor.summary()`` (others, from a newer
    peer, are dropped)."""
    require(isinstance(d, dict) and SUMMARY_KEYS <= set(d), f"cursor summary must have keys {sorted(SUMMARY_KEYS)}")
    # samples_applied is optional: a peer of a build before sample budgets does not send it
    return {key: int_field(d, key) for key in sorted(SUMMARY_KEYS | ({"samples_applied"} & set(d)))}


class Claims:
    """The blocks a trainer holds gradients for (``blocks``, its round claim) and the order it took them in.

    ``lease()``: what its progress report leases: all of them when they fit in ``MAX_LEASE_RANGES`` ranges, else as
    many of the most recently taken as fit. A report kept its first ranges only, the lowest block ids, which say
    nothing of where the peer takes blocks now: in outer mode a part is thousands of scattered blocks, and peers
    whose hands met at a data epoch's end claimed the same blocks (a whole part refused)."""

    def __init__(self) -> None:
        self.blocks = RangeSet()
        self._taken: list[int] = []

    def add(self, blocks: Sequence[int]) -> None:
        self.blocks = self.blocks.add(RangeSet.from_items(blocks))
        self._taken.extend(blocks)

    def copy(self) -> "Claims":
        other = Claims()
        other.blocks, other._taken = self.blocks, list(self._taken)
        return other

    def lease(self) -> RangeSet:
        if len(self.blocks.ranges) <= MAX_LEASE_RANGES:
            return self.blocks
        held: set[int] = set()
        ranges = 0
        for block in reversed(self._taken):  # newest first, while the ranges they make still fit
            if block in held:
                continue
            grown = ranges + 1 - (block - 1 in held) - (block + 1 in held)
            if grown > MAX_LEASE_RANGES:
                break
            held.add(block)
            ranges = grown
        return RangeSet.from_items(held)


@dataclass(frozen=True, kw_only=True)
class SwarmView:
    """What a peer knows of the run from the live progress reports (its own included)."""

    reports: Mapping[str, ProgressReport] = field(default_factory=dict)

    @property
    def trainers(self) -> dict[str, ProgressReport]:
        return {p: r for p, r in self.reports.items() if r.role == Role.TRAINER}

    @property
    def newest_step(self) -> int:
        return max((r.step for r in self.reports.values()), default=0)

    def samples_at(self, step: int) -> int:
        return sum(r.samples for r in self.trainers.values() if r.step == step)

    def finished(self) -> bool:
        return any(r.finished for r in self.reports.values())

    def leased(self, *, me: str, step: int, data_epoch: int) -> RangeSet:
        """Blocks other live trainers at this step hold gradients for (to avoid, not a lock)."""
        out = RangeSet()
        for peer, r in self.trainers.items():
            if peer != me and r.step == step and r.data_epoch == data_epoch:
                out = out.add(r.claimed)
        return out
