"""The step plan: parts by speed in whole blocks, adding up to the target; reconciling with published parts;
when a trainer enters the round."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.plan import Speed, my_quota, plan_step, ready_for_round, round_eta
from swarmrun.protocol.round import ProgressReport, Role, SwarmView


def report(step, sps=1.0, samples=0, quota=None, role=Role.TRAINER, left=False, joining=None):
    return ProgressReport(step=step, samples=samples, samples_per_second=sps, role=role, state_hash="h", time=0.0,
                          quota=quota, left=left, joining=joining)


def test_parts_follow_speed_in_whole_blocks_and_add_up_to_the_target():
    view = SwarmView(reports={"a": report(3, 300.0), "b": report(3, 100.0)})
    plan = plan_step(view, me="a", step=3, my_rate=300.0, target=400, block_size=16)
    assert plan.quotas == {"a": 304, "b": 96} and sum(plan.quotas.values()) == 400
    # a target that is not a multiple of the block: the last member's part is trimmed
    plan = plan_step(view, me="a", step=3, my_rate=300.0, target=100, block_size=16)
    assert sum(plan.quotas.values()) == 100


def test_members_are_live_trainers_at_the_step_or_one_behind():
    view = SwarmView(reports={"me": report(5), "prev": report(4), "prev2": report(3), "old": report(2), "ahead": report(6),
                              "keeper": report(5, role=Role.KEEPER), "gone": report(5, left=True)})
    plan = plan_step(view, me="me", step=5, my_rate=10.0, target=64, block_size=8)
    assert plan.members == ["me", "prev", "prev2"]
    # a newcomer with no speed yet counts at the others' mean
    view = SwarmView(reports={"me": report(5, 10.0), "new": report(5, 0.0)})
    assert plan_step(view, me="me", step=5, my_rate=10.0, target=64, block_size=8).quotas == {"me": 32, "new": 32}


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=8), target=st.integers(1, 5000),
       block=st.integers(1, 64))
def test_every_view_of_the_same_reports_makes_the_same_plan(rates, target, block):
    view = SwarmView(reports={f"p{i}": report(0, r) for i, r in enumerate(rates)})
    plans = [plan_step(view, me=p, step=0, my_rate=view.reports[p].samples_per_second, target=target,
                       block_size=block) for p in view.reports]
    assert all(p == plans[0] for p in plans)
    assert sum(plans[0].quotas.values()) == target and min(plans[0].quotas.values()) >= 0


@settings(max_examples=200, deadline=None)
@given(seen=st.lists(st.lists(st.floats(1.0, 1e4), min_size=4, max_size=4), min_size=4, max_size=4),
       gathered=st.lists(st.floats(1.0, 1e4), min_size=4, max_size=4), target=st.integers(1, 5000),
       block=st.integers(1, 64))
def test_the_members_of_a_committed_round_plan_the_next_step_alike_whatever_their_views(seen, gathered, target, block):
    """Each of four members sees the others' speeds a report old and its own as it is now (``seen[i]``): their own
    parts may not add up to the target; with the speeds the committing round gathered they do, to the sample."""
    peers = [f"p{i}" for i in range(4)]
    agreed = dict(zip(peers, gathered))
    plans = []
    for i, me in enumerate(peers):
        view = SwarmView(reports={p: report(0, seen[i][k]) for k, p in enumerate(peers)})
        plans.append(plan_step(view, me=me, step=0, my_rate=seen[i][i], target=target, block_size=block,
                               agreed=agreed))
    assert all(p == plans[0] for p in plans)
    assert sum(plan.quotas[me] for plan, me in zip(plans, peers)) == target


def test_speeds_seen_apart_make_parts_that_miss_the_target_without_the_agreed_ones():
    """What the links benchmark saw: four members, each its own speed fresh and the others' a report old."""
    peers, block, target = ["a", "b", "c", "d"], 8, 64
    old = {"a": 10.0, "b": 20.0, "c": 20.0, "d": 20.0}
    now = {"a": 20.0, "b": 20.0, "c": 20.0, "d": 20.0}
    view = SwarmView(reports={p: report(0, old[p]) for p in peers})
    parts = {me: plan_step(view, me=me, step=0, my_rate=now[me], target=target, block_size=block).quotas[me]
             for me in peers}
    assert sum(parts.values()) != target  # without agreement: a round of these parts is abandoned
    parts = {me: plan_step(view, me=me, step=0, my_rate=now[me], target=target, block_size=block,
                           agreed=now).quotas[me] for me in peers}
    assert parts == {p: 16 for p in peers}


def test_a_member_of_the_round_whose_report_this_peer_has_not_read_is_planned_all_the_same():
    agreed = {"a": 10.0, "b": 10.0, "j": 10.0}  # j joined the round; a has not read j's report yet
    seen_by_a = SwarmView(reports={"a": report(3, 10.0), "b": report(3, 10.0)})
    seen_by_b = SwarmView(reports={"a": report(3, 10.0), "b": report(3, 10.0), "j": report(3, 10.0)})
    plan_a = plan_step(seen_by_a, me="a", step=3, my_rate=10.0, target=96, block_size=8, agreed=agreed)
    plan_b = plan_step(seen_by_b, me="b", step=3, my_rate=10.0, target=96, block_size=8, agreed=agreed)
    assert plan_a == plan_b and plan_a.quotas == {"a": 32, "b": 32, "j": 32}
    # one member that said it left is out (on every peer that read its report)
    gone = SwarmView(reports={**seen_by_b.reports, "j": report(3, 10.0, left=True)})
    assert plan_step(gone, me="b", step=3, my_rate=10.0, target=96, block_size=8, agreed=agreed).members == ["a", "b"]


def test_a_huge_speed_is_capped_not_an_overflow():
    view = SwarmView(reports={"a": report(3, 1e308), "b": report(3, 10.0)})
    for agreed in ({}, {"a": 1e308, "b": 10.0}):
        plan = plan_step(view, me="b", step=3, my_rate=10.0, target=96, block_size=8, agreed=agreed)
        assert sum(plan.quotas.values()) == 96


def test_after_a_commit_the_plan_waits_for_the_round_and_trainers_at_the_step_not_for_one_behind():
    """The links benchmark's shut-out peer: one step behind at every step (it re-synced by replay while the others
    formed the next group), and counted by their plans, so that every round was short by its part."""
    view = SwarmView(reports={"me": report(5, 10.0), "mate": report(4, 10.0), "behind": report(4, 10.0),
                              "joined": report(5, 10.0), "gone": report(5, 10.0, left=True)})
    agreed = {"me": 10.0, "mate": 10.0, "gone": 10.0}  # "mate" was in the committing round; its report is older
    plan = plan_step(view, me="me", step=5, my_rate=10.0, target=96, block_size=8, agreed=agreed)
    assert plan.members == ["joined", "mate", "me"] and sum(plan.quotas.values()) == 96
    # without a round behind it (this peer re-synced or joined): trainers up to PLAN_LAG behind count, as before
    assert plan_step(view, me="me", step=5, my_rate=10.0, target=96, block_size=8).members == \
        ["behind", "joined", "mate", "me"]


def test_a_trainer_that_asked_for_a_step_is_planned_in_that_step_only():
    """The late joiner of a fast swarm (the CI's liar and stranger tests): its report was read only after the others
    had planned the step it re-synced to, at every step, until it gave up. It asks for a step ahead and waits there."""
    view = SwarmView(reports={"me": report(7, 10.0), "mate": report(7, 10.0), "new": report(5, 10.0, joining=8)})
    agreed = {"me": 10.0, "mate": 10.0}
    for group in (agreed, {}):  # after a commit or not, it is not waited for before its step...
        assert plan_step(view, me="me", step=7, my_rate=10.0, target=96, block_size=8, agreed=group).members == \
            ["mate", "me"]
        # ...and it is a member of its step however far behind its report still is (it replays on its way there)
        plan = plan_step(view, me="me", step=8, my_rate=10.0, target=96, block_size=8, agreed=group)
        assert plan.members == ["mate", "me", "new"] and sum(plan.quotas.values()) == 96
    # an ask the swarm went past counts no more (the trainer asks again), and one that left is out
    assert plan_step(view, me="me", step=9, my_rate=10.0, target=96, block_size=8).members == ["mate", "me"]
    gone = SwarmView(reports={"me": report(8, 10.0), "new": report(7, 10.0, joining=8, left=True)})
    assert plan_step(gone, me="me", step=8, my_rate=10.0, target=96, block_size=8).members == ["me"]
    # the ask travels in the report
    assert ProgressReport.decode(report(5, joining=8).encode()).joining == 8
    assert ProgressReport.decode(report(5).encode()).joining is None


def test_a_short_sum_of_published_parts_goes_to_the_first_member_a_surplus_off_the_last():
    view = SwarmView(reports={"a": report(3, 1.0), "b": report(3, 1.0)})
    plan = plan_step(view, me="a", step=3, my_rate=1.0, target=64, block_size=8)
    assert plan.quotas == {"a": 32, "b": 32}
    short = SwarmView(reports={"a": report(3, 1.0), "b": report(3, 1.0, quota=24)})
    assert my_quota(plan, short, me="a", step=3, samples=0) == 40
    plan_b = plan_step(short, me="b", step=3, my_rate=1.0, target=64, block_size=8)
    assert my_quota(plan_b, SwarmView(reports={"a": report(3, 1.0, quota=40), "b": report(3)}), me="b", step=3,
                    samples=8) == 24  # b is the last member: it gives back what a took on
    # a published part of another step does not count; what was computed is never given back
    stale = SwarmView(reports={"a": report(2, 1.0, quota=64), "b": report(3)})
    assert my_quota(plan_b, stale, me="b", step=3, samples=0) == 32
    over = SwarmView(reports={"a": report(3, 1.0, quota=60), "b": report(3)})
    assert my_quota(plan_b, over, me="b", step=3, samples=16) == 16


def test_no_part_reaches_past_what_the_others_at_the_step_already_computed():
    """CI's outer trace: "a" held 224 of a 256-sample step when its partner "z" was killed (its report still live,
    a part of 32 published); joiner "b" planned a third of the step and the surplus fell on "z", the last member,
    which was gone: b brought 48 and the step carried 272. Its part is what the others' computed samples leave."""
    view = SwarmView(reports={"a": report(6, 1.0, samples=224, quota=224), "z": report(6, 1.0, quota=32),
                              "b": report(6)})
    plan = plan_step(view, me="b", step=6, my_rate=1.0, target=256, block_size=8)
    assert plan.quotas["b"] > 32  # its share of the plan by speed
    assert my_quota(plan, view, me="b", step=6, samples=0) == 32
    assert my_quota(plan, view, me="b", step=6, samples=40) == 40  # what it computed is never given back
    done = SwarmView(reports={**view.reports, "z": report(6, 1.0, samples=32, quota=32)})
    assert my_quota(plan, done, me="b", step=6, samples=0) == 0
    assert ready_for_round(done, me="b", step=6, samples=0, quota=0, target=256)  # it joins the round empty-handed
    # one that said it left brings nothing: its computed samples leave room
    gone = SwarmView(reports={**view.reports, "z": report(6, 1.0, samples=32, quota=32, left=True)})
    assert my_quota(plan, gone, me="b", step=6, samples=0) == 32


def test_entering_the_round_and_its_eta():
    view = SwarmView(reports={"me": report(3), "b": report(3, 8.0, samples=16, quota=48), "c": report(2, 1.0)})
    assert not ready_for_round(view, me="me", step=3, samples=24, quota=32, target=80)
    assert ready_for_round(view, me="me", step=3, samples=32, quota=32, target=80)
    # with nothing to bring: only when the others' parts make the step
    assert not ready_for_round(view, me="me", step=3, samples=0, quota=0, target=49)
    assert ready_for_round(view, me="me", step=3, samples=0, quota=0, target=48)
    plan = plan_step(view, me="me", step=3, my_rate=8.0, target=80, block_size=8)
    # b has 32 samples left at 8/s; c (one step behind, 1 sample/s) has its whole part of this plan ahead of it
    assert round_eta(plan, view, me="me", step=3) == max(4.0, plan.quotas["c"] / 1.0)
    assert round_eta(plan, SwarmView(reports={"me": report(3)}), me="me", step=3) == 0.0


def test_a_trainer_behind_by_a_fresh_report_is_not_waited_for():
    def at(step, time):
        return ProgressReport(step=step, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="h",
                              time=time)

    # this peer reached step 5 at t=100: a report of step 4 from t=99 is stale (that peer commits too), one from
    # t=101 says the peer is still behind (re-syncing): the step is not planned with it
    view = SwarmView(reports={"me": at(5, 100.0), "stale": at(4, 99.0), "behind": at(4, 101.0)})
    plan = plan_step(view, me="me", step=5, my_rate=1.0, target=64, block_size=8, since=100.0)
    assert plan.members == ["me", "stale"]


def test_a_speed_pools_whole_parts_not_the_last_batches():
    """Two peers share a core: each computes 1,000 samples/s while both compute. The one whose part ends last runs
    alone for its last batches at 2,000/s; an average of its last batches called it twice as fast and planned it
    twice the part. Pooled over whole parts both are about as fast as they were under the same contention."""
    first, last = Speed(), Speed()
    assert first.value == 0.0  # nothing computed yet: no speed
    for _ in range(Speed.MIN_BATCHES):  # both compute at once
        first.add(100, 0.1)
        last.add(100, 0.1)
    for _ in range(2):  # the first is done; the last runs alone
        assert last.add(100, 0.05) < 1100
    first.close()
    last.close()
    assert first.value == pytest.approx(1000) and last.value == pytest.approx(1800 / 1.7)
    first.add(50, 0.1)  # the next part's first batch is pooled with the whole last part
    assert first.value == pytest.approx(1650 / 1.7)
    first.close()
    first.close()  # a part that computed nothing leaves no trace
    assert first.add(100, 0.1) == pytest.approx(1750 / 1.8)  # the current part, and the last ones up to 16 batches


def test_one_stalled_batch_of_a_tiny_part_does_not_become_the_speed():
    """Parts of one batch (8 peers, a small target): a batch that stalled 50 times as long as the others weighs as
    one of the last 16, so the speed stays within the same order and the plan still gives this peer blocks."""
    speed = Speed()
    for _ in range(20):
        speed.add(8, 0.01)
        speed.close()
    speed.add(8, 0.5)
    speed.close()
    assert speed.value == pytest.approx(16 * 8 / (15 * 0.01 + 0.5))
    assert speed.value > 800 / 5
    for _ in range(Speed.MIN_BATCHES):  # it computes again: the stall leaves the window
        speed.add(8, 0.01)
        speed.close()
    assert speed.value == pytest.approx(800)
