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


def test_a_members_hand_stays_its_own_after_a_commit():
    """Blocks member 0 computed while member 1's part was committed (work computed ahead, ``outer_overlap``) are not
    in member 1's hand after the commit: hands are dealt from the data order once per epoch, not from what is left."""
    from swarmrun.protocol.plan import pick_blocks

    cursor = DataCursor.new(seed=3, num_examples=8 * 40, block_size=8)
    a = pick_blocks(cursor, 10, member=0, members=2, exclude=RangeSet())
    b = pick_blocks(cursor, 10, member=1, members=2, exclude=RangeSet())
    after = cursor.apply(RangeSet.from_items(b))  # member 1's blocks committed, member 0's still computing
    assert not set(pick_blocks(after, 10, member=1, members=2, exclude=RangeSet())) & set(a)
    assert pick_blocks(after, 10, member=0, members=2, exclude=RangeSet()) == a
    # two members whose hands are spent share the back of a third's: different blocks, not the same ones
    three = DataCursor.new(seed=3, num_examples=8 * 60, block_size=8)
    spent = [pick_blocks(three, 20, member=m, members=3, exclude=RangeSet()) for m in (0, 1)]
    late = three.apply(RangeSet.from_items(spent[0] + spent[1] + pick_blocks(three, 5, member=2, members=3,
                                                                               exclude=RangeSet())))
    x, y = (pick_blocks(late, 4, member=m, members=3, exclude=RangeSet()) for m in (0, 1))
    assert len(x) == len(y) == 4 and not set(x) & set(y)
    assert len(set(pick_blocks(late, 15, member=0, members=3, exclude=RangeSet()))) == 15  # every free block at last


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
    from swarmrun.protocol.history import should_resync

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
    from swarmrun.protocol.history import run_accounting

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


def test_the_history_with_the_newest_majority_commit_wins_a_reunion():
    """Two sides of a split meet again: the side whose history holds the newest majority commit (its anchor) wins,
    even at an older step; the other re-syncs to it. Without a newer majority commit anywhere, the old rule (the
    newest step wins) holds, and a peer on the winning history simply behind follows as before."""
    from swarmrun.protocol.history import best_anchor, outranked, should_resync

    def rep(step, h, anchor):
        return ProgressReport(step=step, samples=0, samples_per_second=0.0, role=Role.TRAINER, state_hash=h, time=0.0,
                              anchor=anchor)

    # a 3-peer run split at step 42 (anchor (42, "s42")): a and b went on as a majority (anchor 100), c alone
    # (minority commits: anchor still 42) reached step 2000
    reunion = SwarmView(reports={"a": rep(100, "a100", (100, "a100")), "b": rep(100, "a100", (100, "a100")),
                                 "c": rep(2000, "c2000", (42, "s42"))})
    assert best_anchor(reunion) == (100, "a100")
    assert should_resync(reunion, me="c", step=2000, state_hash="c2000", anchor=(42, "s42"))  # the minority re-syncs
    assert not should_resync(reunion, me="a", step=100, state_hash="a100", anchor=(100, "a100"))  # c is not followed
    # the majority steps faster than its reports travel: its members' reports carry anchors a step apart, which
    # back each other's older one; the minority that outstepped it after the heal is outranked all the same, and
    # the majority does not follow it (the split trace: a pair lost 27 committed steps to the lone peer, not counted)
    apart = SwarmView(reports={"a": rep(54, "a54", (54, "a54")), "b": rep(53, "a53", (53, "a53")),
                               "c": rep(60, "c60", (26, "s26"))})
    assert best_anchor(apart) == (53, "a53")
    assert not should_resync(apart, me="a", step=54, state_hash="a54", anchor=(54, "a54"))
    assert should_resync(apart, me="c", step=60, state_hash="c60", anchor=(26, "s26"))
    # a peer of the majority one step behind follows its side as before, not the minority far ahead
    lagging = SwarmView(reports={**reunion.reports, "b": rep(99, "a99", (99, "a99"))})
    assert should_resync(lagging, me="b", step=99, state_hash="a99", anchor=(99, "a99"))
    # ... and a peer of the minority behind its own anchor's step is not outranked: it has not passed the split
    assert not outranked(41, (41, "s41"), (100, "a100")) and outranked(100, (42, "s42"), (100, "a100"))
    # a 1-1 split (both sides minority commits since 42: the same anchor): the newest step wins, as before
    even = SwarmView(reports={"a": rep(60, "a60", (42, "s42")), "c": rep(70, "c70", (42, "s42"))})
    assert should_resync(even, me="a", step=60, state_hash="a60", anchor=(42, "s42"))
    assert not should_resync(even, me="c", step=70, state_hash="c70", anchor=(42, "s42"))
    # unknown anchors (a joiner before its first state, an earlier build) keep the old rule both ways
    assert should_resync(SwarmView(reports={"c": rep(2000, "c", None)}), me="a", step=100, state_hash="a",
                         anchor=(100, "a100"))
    assert not outranked(2000, None, (100, "a100"))
    # two anchors at one step, each carried by one report (majority commits on two histories, e.g. after membership
    # memory ran out): neither outranks the other, and the rule at a step decides (ties to the smaller hash)
    tie = SwarmView(reports={"a": rep(50, "a50", (50, "a50")), "c": rep(50, "c50", (50, "c50"))})
    assert not should_resync(tie, me="a", step=50, state_hash="a50", anchor=(50, "a50"))
    assert should_resync(tie, me="c", step=50, state_hash="c50", anchor=(50, "c50"))


def test_a_peer_discards_its_history_only_on_evidence_from_its_own_ledger():
    """The reunion rule re-syncs a peer only if its ledger holds another state at the winning anchor's step: an
    anchor that lagged (a state fetched from a provider whose record was a step old) never makes a peer of the
    winning history discard it. And one report alone never names the swarm's newest anchor (a liar's)."""
    from swarmrun.protocol.history import Ledger, best_anchor, should_resync

    def rep(step, h, anchor):
        return ProgressReport(step=step, samples=0, samples_per_second=0.0, role=Role.TRAINER, state_hash=h, time=0.0,
                              anchor=anchor)

    majority = {"a": rep(100, "a100", (100, "a100")), "b": rep(100, "a100", (100, "a100"))}
    minority = Ledger()
    for step in range(42, 2001):
        minority.add(step, "s42" if step == 42 else f"c{step}")
    view = SwarmView(reports={**majority, "c": rep(2000, "c2000", (42, "s42"))})
    assert should_resync(view, me="c", step=2000, state_hash="c2000", anchor=(42, "s42"), ledger=minority)
    # the same anchors, but this peer's ledger holds the majority's state at step 100: one history, a lagging anchor
    same = Ledger()
    for step in range(90, 106):
        same.add(step, f"a{step}")
    assert same.holds((100, "a100")) and same.holds((100, "x")) is False and same.holds((5, "x")) is None
    lag = SwarmView(reports={**majority, "d": rep(105, "a105", (90, "a90"))})
    assert not should_resync(lag, me="d", step=105, state_hash="a105", anchor=(90, "a90"), ledger=same)
    # a lineage adopted after the anchor's step (a fetched state): no evidence, no re-sync
    fetched = Ledger()
    fetched.reset(103, "a103")
    assert not should_resync(lag, me="d", step=103, state_hash="a103", anchor=(90, "a90"), ledger=fetched)
    # ... unless the ledger dropped that far back: then the anchors alone decide
    long = Ledger()
    long.truncated = True
    long.reset(150, "c150")
    long.truncated = True
    assert should_resync(view, me="c", step=150, state_hash="c150", anchor=(42, "s42"), ledger=long)
    # one report with a newer anchor is not the swarm's newest majority commit: no one discards anything for it
    liar = SwarmView(reports={**majority, "x": rep(100, "x100", (100, "zzz"))})
    assert best_anchor(liar) == (100, "a100")
    far = SwarmView(reports={**majority, "x": rep(10**6, "x", (10**6, "x"))})  # a lone anchor far ahead decides nothing
    assert best_anchor(far) == (100, "a100")
    assert not should_resync(liar, me="a", step=100, state_hash="a100", anchor=(100, "a100"), ledger=same)
    assert best_anchor(SwarmView(reports={"x": rep(100, "x", (100, "x"))})) is None


def test_a_ledger_keeps_the_newest_steps_of_one_lineage():
    from swarmrun.protocol import history

    ledger = history.Ledger()
    assert ledger.newest == -1
    ledger.reset(10, "h10")
    for step in range(11, 11 + history.MAX_LEDGER):
        ledger.add(step, f"h{step}")
    assert ledger.truncated and len(ledger.hashes) == history.MAX_LEDGER and ledger.holds((10, "h10")) is None
    assert ledger.newest == 10 + history.MAX_LEDGER and ledger.holds((11, "h11"))
    ledger.reset(5, "other")
    assert not ledger.truncated and ledger.hashes == {5: "other"}


def test_a_round_advances_the_anchor_only_with_a_majority_of_the_remembered_membership():
    from swarmrun.protocol.round import majority_round

    def v(members, live=0):
        return Vote(step=0, group_id="g", grad_hash="x", ok=True, live=live, members=members)

    # a 3-peer run whose third peer vanished without saying it left: 2 of 3 is a majority, 1 of 3 is not
    assert majority_round({"a": v(3), "b": v(3)}, ["a", "b"])
    assert not majority_round({"c": v(3)}, ["c"])
    # the largest count any member remembers decides (one member forgot the vanished peer: the round agrees)
    assert not majority_round({"a": v(2), "b": v(4)}, ["a", "b"])
    # a vote of an earlier build (no members) counts its live trainers; alone in a run of one: a majority
    assert majority_round({"a": v(0, live=2), "b": v(0, live=2)}, ["a", "b"]) and majority_round({"a": v(1)}, ["a"])
    assert Vote.decode(v(5).encode()).members == 5 and Vote.decode(v(0, live=2).encode()).members == 0


def test_claims_keep_the_fullest_subset_that_fits():
    # greedy in gathered order would keep 24 + 24 and stop short of 64; the fullest subset is 24 + 40
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5]), meta([6, 7, 8, 9, 10])], CURSOR, target=64, tolerance=0.05)
    assert d.samples == 64 and d.excess == (1,) and d.weights == (24.0, 0.0, 40.0)
    # a peer that computed a whole target alone (waiting for --min-peers) next to two smaller parts: one part of 64
    d = decide_claims([meta([0, 1, 2]), meta([3, 4, 5, 6, 7, 8, 9, 10]), meta([11])], CURSOR, target=64)
    assert d.samples == 64 and d.excess == (0, 2)


def test_a_reunion_of_two_peers_is_decided_by_the_newest_step():
    """One peer per side (the other of the majority crashed meanwhile): neither anchor is carried by two reports, so
    neither side excludes the other and the rule at a step decides (the newest step wins). With a peer's own anchor
    counted as a second voice, both sides ignored each other and failed their rounds forever (review of f6633d6)."""
    from swarmrun.protocol.history import should_resync

    def rep(step, h, anchor):
        return ProgressReport(step=step, samples=0, samples_per_second=0.0, role=Role.TRAINER, state_hash=h, time=0.0,
                              anchor=anchor)

    view = SwarmView(reports={"p0": rep(30, "m30", (20, "m20")), "p2": rep(40, "s40", (8, "s8"))})
    assert should_resync(view, me="p0", step=30, state_hash="m30", anchor=(20, "m20"))
    assert not should_resync(view, me="p2", step=40, state_hash="s40", anchor=(8, "s8"))


def test_a_member_learns_the_blocks_the_others_claimed_in_the_round_whatever_they_lease():
    """A part computed alone before the others came is thousands of scattered blocks, more than a report leases;
    the round's gathered claims say them all. A refused member's claim is dropped (it recomputes its part)."""
    from swarmrun.protocol.round import held_by_others

    big = RangeSet.from_items(range(0, 2000, 3))  # 667 ranges: a report leases 256 of them
    metas = [RoundMeta(spec_hash="h", step=4, samples=8 * len(big), blocks=big, data_epoch=0),
             RoundMeta(spec_hash="h", step=4, samples=16, blocks=RangeSet.from_items([1, 3]), data_epoch=0),
             RoundMeta(spec_hash="h", step=4, samples=8, blocks=RangeSet.from_items([5000]), data_epoch=0)]
    peers = ["big", "me", "late"]
    assert len(big.ranges) > MAX_LEASE_RANGES
    late = RangeSet.from_items([5000])
    assert held_by_others(metas, peers, me="me", refused=(1,)) == {"big": big, "late": late}
    assert held_by_others(metas, peers, me="me", refused=(1, 2)) == {"big": big}  # a refused member drops its claim
    assert held_by_others(metas, peers, me="big") == {"me": RangeSet.from_items([1, 3]), "late": late}
