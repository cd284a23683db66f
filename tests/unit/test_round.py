"""The round's pure decisions: claims, weights, the commit vote, the step trigger, message bounds."""

import dataclasses

import pytest

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.errors import RemoteProtocolError
from swarmrun.protocol.round import (
    MAX_LEASE_RANGES,
    Abandon,
    Claims,
    Commit,
    ProgressReport,
    Role,
    RoundMeta,
    SwarmView,
    Vote,
    claim_samples,
    decide_claims,
    decide_commit,
    step_bounds,
)

CURSOR = DataCursor.new(seed=1, num_examples=100, block_size=8)  # 13 blocks, the last one holds 4


def meta(blocks, samples=None, epoch=0, step=0):
    rs = RangeSet.from_items(blocks)
    return RoundMeta(spec_hash="ab" * 32, step=step, samples=claim_samples(rs, CURSOR) if samples is None else samples,
                     blocks=rs, data_epoch=epoch)


def test_claims_weight_by_samples_of_blocks():
    d = decide_claims([meta([0, 1]), meta([2]), meta([12])], CURSOR)
    assert d.weights == (16.0, 8.0, 4.0)
    assert d.samples == 28 and d.refused == ()
    assert set(d.applied) == {0, 1, 2, 12}


def test_overlapping_claim_gets_weight_zero_and_is_not_applied():
    d = decide_claims([meta([0, 1]), meta([1, 2]), meta([5])], CURSOR)
    assert d.weights == (16.0, 0.0, 8.0)  # the first of the overlapping claims keeps its blocks
    assert d.refused == (1,)
    assert set(d.applied) == {0, 1, 5}


def test_pick_blocks_partitions_the_order_among_trainers():
    from swarmrun.protocol.plan import pick_blocks

    cursor = DataCursor.new(seed=3, num_examples=8 * 40, block_size=8)
    a = pick_blocks(cursor, 10, member=0, members=2, exclude=RangeSet())
    b = pick_blocks(cursor, 10, member=1, members=2, exclude=RangeSet())
    assert len(a) == len(b) == 10 and not set(a) & set(b)
    after = cursor.apply(RangeSet.from_items(a + b))
    assert not set(pick_blocks(after, 10, member=0, members=2, exclude=RangeSet())) & set(a + b)
    # near the end of an epoch a trainer takes any free block rather than none
    rest = pick_blocks(after, 40, member=0, members=2, exclude=RangeSet())
    assert len(rest) == 20 and not set(rest) & set(a + b)


def test_claims_on_applied_blocks_or_other_epoch_or_lying_counts_are_refused():
    cursor = CURSOR.apply(RangeSet.from_items([3]))
    d = decide_claims([meta([3, 4]), meta([6], epoch=1), meta([7], samples=1000), meta([8])], cursor)
    assert d.weights == (0.0, 0.0, 0.0, 8.0)
    assert set(d.applied) == {8}


def test_claims_outside_the_dataset_are_refused():
    d = decide_claims([meta([13], samples=8), meta([0])], CURSOR)
    assert d.weights == (0.0, 8.0)


def vote(ok=True, grad="g", group="aa", step=0):
    return Vote(step=step, group_id=group, grad_hash=grad, ok=ok)


def test_commit_needs_every_vote_agreeing_majority_and_target():
    group = ["a", "b", "c"]
    votes = {p: vote() for p in group}
    assert decide_commit(mine=vote(), votes=votes, group=group, live_trainers=4, samples=64, target_batch_size=64) == Commit()
    # a missing vote, a failed one, a different gradient: abandoned
    assert isinstance(decide_commit(mine=vote(), votes={"a": vote(), "b": vote()}, group=group, live_trainers=3,
                                    samples=64, target_batch_size=64), Abandon)
    assert isinstance(decide_commit(mine=vote(), votes={**votes, "c": vote(ok=False)}, group=group, live_trainers=3,
                                    samples=64, target_batch_size=64), Abandon)
    assert isinstance(decide_commit(mine=vote(), votes={**votes, "b": vote(grad="x")}, group=group, live_trainers=3,
                                    samples=64, target_batch_size=64), Abandon)
    # not a majority of live trainers, not enough samples, my own all-reduce incomplete
    assert isinstance(decide_commit(mine=vote(), votes=votes, group=group, live_trainers=6, samples=64,
                                    target_batch_size=64), Abandon)
    assert isinstance(decide_commit(mine=vote(), votes=votes, group=group, live_trainers=3, samples=63,
                                    target_batch_size=64), Abandon)
    assert isinstance(decide_commit(mine=vote(ok=False), votes=votes, group=group, live_trainers=3, samples=64,
                                    target_batch_size=64), Abandon)


def report(step, samples, role=Role.TRAINER, claimed=()):
    return ProgressReport(step=step, samples=samples, samples_per_second=1.0, role=role, state_hash="h", time=0.0,
                          claimed=RangeSet.from_items(claimed))


def test_a_report_leases_the_blocks_taken_last_when_all_do_not_fit():
    claims = Claims()
    claims.add([10, 11, 12])
    assert claims.lease() == RangeSet.from_items([10, 11, 12])  # all of them, when they fit
    scattered = list(range(0, 4 * MAX_LEASE_RANGES, 2))  # a part of outer mode: one range per block
    claims.add(scattered)
    assert len(claims.blocks.ranges) > MAX_LEASE_RANGES
    lease = claims.lease()
    assert lease == RangeSet.from_items(scattered[-MAX_LEASE_RANGES:])  # where this peer takes blocks now
    sent = dataclasses.replace(report(1, 2), claimed=lease)
    assert ProgressReport.decode(sent.encode()).claimed == lease  # it fits whole in a report
    # runs of blocks lease as many blocks as their ranges allow, not one block per range
    runs = Claims()
    for start in range(0, 20 * 2 * MAX_LEASE_RANGES, 20):
        runs.add(list(range(start, start + 10)))  # 2 * MAX_LEASE_RANGES runs of 10
    lease = runs.lease()
    assert len(lease.ranges) == MAX_LEASE_RANGES and len(lease) == 10 * MAX_LEASE_RANGES
    assert max(lease) == 20 * (2 * MAX_LEASE_RANGES - 1) + 9  # the newest run is in it


def test_leases_of_other_trainers_at_my_step():
    view = SwarmView(reports={"me": report(3, 0, claimed=[1]), "b": report(3, 8, claimed=[4, 5]),
                              "c": report(2, 8, claimed=[7])})
    assert set(view.leased(me="me", step=3, data_epoch=0)) == {4, 5}


def test_messages_roundtrip_and_reject_garbage():
    m = meta([0, 1])
    assert RoundMeta.decode(m.encode()) == m
    fast = dataclasses.replace(m, ready_at=12.5, rate=310.25)  # the speed every member plans the next step with
    assert RoundMeta.decode(fast.encode()) == fast
    for rate in (float("nan"), float("inf"), "fast"):
        with pytest.raises(RemoteProtocolError):
            RoundMeta.decode(pack(unpack(m.encode()) | {"rate": rate}))
    v = vote()
    assert Vote.decode(v.encode()) == v
    r = report(1, 2, claimed=[3])
    assert ProgressReport.decode(r.encode()) == r
    for bad in (b"", b"\xc1", b"\x92\x01\x02", m.encode()[:-3], b"\x81\xa4type\xa4vote"):
        with pytest.raises(RemoteProtocolError):
            RoundMeta.decode(bad)
        with pytest.raises(RemoteProtocolError):
            Vote.decode(bad)
        with pytest.raises(RemoteProtocolError):
            ProgressReport.decode(bad)


def test_resync_when_behind_or_outvoted_at_my_step():
    from swarmrun.protocol.round import should_resync

    def rep(step, h):
        return ProgressReport(step=step, samples=0, samples_per_second=0.0, role=Role.TRAINER, state_hash=h, time=0.0)

    ahead = SwarmView(reports={"me": rep(3, "x"), "b": rep(4, "y")})
    assert should_resync(ahead, me="me", step=3, state_hash="x")
    agree = SwarmView(reports={"me": rep(3, "x"), "b": rep(3, "x"), "c": rep(2, "z")})
    assert not should_resync(agree, me="me", step=3, state_hash="x")
    outvoted = SwarmView(reports={"me": rep(3, "x"), "b": rep(3, "y"), "c": rep(3, "y")})
    assert should_resync(outvoted, me="me", step=3, state_hash="x")
    assert not should_resync(outvoted, me="b", step=3, state_hash="y")
    tie = SwarmView(reports={"me": rep(3, "b-hash"), "o": rep(3, "a-hash")})
    assert should_resync(tie, me="me", step=3, state_hash="b-hash")
    assert not should_resync(tie, me="o", step=3, state_hash="a-hash")


def test_progress_report_carries_the_cursor_summary_and_tolerates_its_absence():
    from swarmrun.protocol.codec import pack, unpack
    from swarmrun.protocol.round import run_accounting

    summary = CURSOR.apply(RangeSet.from_items([0, 1])).summary()
    r = ProgressReport(step=4, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="h", time=0.0,
                       cursor=summary)
    assert ProgressReport.decode(r.encode()) == r
    plain = unpack(r.encode())
    del plain["cursor"]  # a peer of an older version sends none
    assert ProgressReport.decode(pack(plain)).cursor is None
    for bad in ({"blocks_applied": 1}, {**summary, "blocks_pending": -1}, [1, 2], {**summary, "data_epoch": "0"}):
        with pytest.raises(RemoteProtocolError):
            ProgressReport.decode(pack({**plain, "cursor": bad}))
    newer = ProgressReport.decode(pack({**plain, "cursor": {**summary, "blocks_new": 3}}))
    assert newer.cursor == summary  # keys of a newer peer are dropped
    # the run's accounting: from the newest step, from the state most trainers there hold
    other = {**summary, "blocks_applied": 99}
    view = SwarmView(reports={
        "a": ProgressReport(step=4, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="y", time=0.0, cursor=other),
        "b": ProgressReport(step=4, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="x", time=0.0, cursor=summary),
        "c": ProgressReport(step=4, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="x", time=0.0),
        "d": ProgressReport(step=3, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="z", time=0.0, cursor=other),
    })
    assert run_accounting(view) == summary
    assert run_accounting(SwarmView(reports={"c": view.reports["c"]})) is None


def test_claims_keep_the_step_within_its_size_bounds():
    assert step_bounds(64, 0.05) == (61, 67) and step_bounds(80, 0.0) == (80, 80)
    # 3 participants of 24 for a target of 48: the third would take the step to 72 > 50: left out, not refused
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5]), meta([6, 7, 8])], CURSOR, target=48, tolerance=0.05)
    assert d.samples == 48 and d.excess == (2,) and d.refused == () and d.weights == (24.0, 24.0, 0.0)
    assert set(d.applied) == {0, 1, 2, 3, 4, 5}
    # a later claim that still fits is taken after one that did not
    d = decide_claims([meta([0]), meta([1, 2, 3, 4, 5]), meta([6])], CURSOR, target=16, tolerance=0.05)
    assert d.samples == 16 and d.excess == (1,)
    # what fits stays short of the lower bound: every valid claim is taken (a larger step, no work lost)
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5])], CURSOR, target=40, tolerance=0.05)
    assert d.samples == 48 and d.excess == () and d.weights == (24.0, 24.0)
    # an overlapping claim is refused as before, whatever the target
    d = decide_claims([meta([0, 1]), meta([1, 2]), meta([5])], CURSOR, target=24)
    assert d.refused == (1,) and d.samples == 24


def test_commit_takes_a_short_step_within_the_tolerance():
    votes = {"a": Vote(step=3, group_id="g", grad_hash="h", ok=True), "b": Vote(step=3, group_id="g", grad_hash="h", ok=True)}
    kw = dict(mine=votes["a"], votes=votes, group=["a", "b"], live_trainers=2)
    assert decide_commit(**kw, samples=96, target_batch_size=100, tolerance=0.05) == Commit()
    assert isinstance(decide_commit(**kw, samples=94, target_batch_size=100, tolerance=0.05), Abandon)
    assert isinstance(decide_commit(**kw, samples=96, target_batch_size=100), Abandon)


def test_two_groups_with_partial_views_cannot_both_commit():
    """Group A = {a, b} sees 3 trainers, group B = {c, d, e} sees 5; B's members saw all 5: A is no majority."""
    from swarmrun.protocol.round import Abandon, Commit, Vote, decide_commit

    def votes(group, gid, live):
        return {p: Vote(step=0, group_id=gid, grad_hash="h" * 64, ok=True, live=live) for p in group}

    a = votes(["a", "b"], "g1", live=3)
    assert isinstance(decide_commit(mine=a["a"], votes=a, group=["a", "b"], live_trainers=3, samples=64,
                                    target_batch_size=64), Commit)  # alone with its view, A would commit...
    a["b"] = Vote(step=0, group_id="g1", grad_hash="h" * 64, ok=True, live=5)  # ...but b saw 5 trainers
    assert isinstance(decide_commit(mine=a["a"], votes=a, group=["a", "b"], live_trainers=3, samples=64,
                                    target_batch_size=64), Abandon)
    b = votes(["c", "d", "e"], "g2", live=5)
    assert isinstance(decide_commit(mine=b["c"], votes=b, group=["c", "d", "e"], live_trainers=5, samples=64,
                                    target_batch_size=64), Commit)
    # a vote from an older peer without the field counts as 0
    from swarmrun.protocol.codec import pack, unpack

    old = pack({k: v for k, v in unpack(b["c"].encode()).items() if k != "live"})
    assert Vote.decode(old).live == 0


def test_votes_count_only_from_members_of_the_round():
    from swarmrun.protocol.round import round_votes, vote_wait_over

    group = ["a", "b"]
    mine = vote(group="g1")
    seen = {"a": mine, "stranger": vote(ok=False, group="g1"), "c": vote(ok=False, group="g0"),
            "b": vote(group="g0")}  # b's vote of an earlier attempt at this step (another group)
    counted = round_votes(seen, group=group, group_id="g1", step=0)
    assert counted == {"a": mine}
    # a stranger's ok=False never ends a member's wait, never abandons the round
    assert not vote_wait_over(mine=mine, votes=counted, group=group)
    counted = round_votes({**seen, "b": vote(group="g1")}, group=group, group_id="g1", step=0)
    assert vote_wait_over(mine=mine, votes=counted, group=group)
    assert decide_commit(mine=mine, votes=counted, group=group, live_trainers=2, samples=64,
                         target_batch_size=64) == Commit()
    # a member's ok=False does end the wait; so does my own
    failed = round_votes({**seen, "b": vote(ok=False, group="g1")}, group=group, group_id="g1", step=0)
    assert vote_wait_over(mine=mine, votes=failed, group=group)
    assert vote_wait_over(mine=vote(ok=False, group="g1"), votes={}, group=group)
    # a vote for another step under the same key slot is not counted
    assert round_votes({"b": vote(step=256, group="g1")}, group=group, group_id="g1", step=0) == {}


def test_claims_keep_the_fullest_subset_that_fits():
    # greedy in gathered order would keep 24 + 24 and stop short of 64; the fullest subset is 24 + 40
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5]), meta([6, 7, 8, 9, 10])], CURSOR, target=64, tolerance=0.05)
    assert d.samples == 64 and d.excess == (1,) and d.weights == (24.0, 0.0, 40.0)
    # a peer that computed a whole target alone (waiting for --min-peers) next to two smaller parts: one part of 64
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5, 6, 7, 8, 9, 10]), meta([11])], CURSOR, target=64)
    assert d.samples == 64 and d.excess == (0, 2)
