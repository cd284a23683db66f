"""The transfer's pure parts, in memory: the plan under lying, slow and dying providers; records; messages."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.errors import RemoteProtocolError
from swarmrun.protocol.transfer import (
    Chunk,
    Get,
    Open,
    Opened,
    ProviderRecord,
    Refused,
    TransferPlan,
    choose_state,
    decode_message,
    header_length,
    log_sources,
)

H = [c * 64 for c in "0123456789abcdef"]


def _simulate(plan: TransferPlan, behaviour: dict[str, str], speed: dict[str, int], seed: int = 0, max_ticks: int = 10_000):
    """Drive a plan like the fetcher does: each tick, each provider with work sends up to ``speed`` chunks.

    behaviour: "ok", "liar" (every chunk corrupt), "dies@N" (fails after N chunks, then refuses).
    Returns chunks received per provider (verified) and ticks used.
    """
    sent = {p: 0 for p in behaviour}
    got = {p: 0 for p in behaviour}
    rng = random.Random(seed)
    for p in behaviour:
        plan.add_provider(p)
    for tick in range(max_ticks):
        if plan.finished or plan.stalled:
            return got, tick
        order = list(behaviour)
        rng.shuffle(order)
        for p in order:
            for _ in range(speed[p]):
                index = plan.next_chunk(p)
                if index is None:
                    break
                kind = behaviour[p]
                if kind == "liar":
                    plan.chunk_bad(p, index)
                    break
                if kind.startswith("dies@") and sent[p] >= int(kind[5:]):
                    plan.provider_failed(p)
                    break
                sent[p] += 1
                if plan.chunk_ok(p, index, 1):
                    got[p] += 1
    raise AssertionError("the plan did not finish or stall")


def test_fast_provider_serves_more():
    plan = TransferPlan(100)
    got, _ = _simulate(plan, {"fast": "ok", "slow": "ok"}, {"fast": 4, "slow": 1})
    assert plan.finished and got["fast"] + got["slow"] == 100
    assert got["fast"] > 2 * got["slow"]


def test_liar_is_banned_and_its_chunks_requeued():
    plan = TransferPlan(50)
    got, _ = _simulate(plan, {"liar": "liar", "honest": "ok"}, {"liar": 3, "honest": 1})
    assert plan.finished and got["honest"] == 50 and got["liar"] == 0
    assert not plan.usable("liar")
    assert plan.next_chunk("liar") is None


def test_dying_provider_chunks_go_elsewhere():
    plan = TransferPlan(60, max_failures=1)
    got, _ = _simulate(plan, {"dies": "dies@10", "ok": "ok"}, {"dies": 5, "ok": 1})
    assert plan.finished and got["dies"] == 10 and got["ok"] == 50


def test_every_provider_gone_stalls_and_resume_keeps_what_verified():
    plan = TransferPlan(40, max_failures=1)
    got, _ = _simulate(plan, {"a": "dies@7", "b": "dies@5"}, {"a": 2, "b": 2})
    assert plan.stalled and not plan.finished and len(plan.done) == 12
    resumed = TransferPlan(40, have=plan.done)
    got, _ = _simulate(resumed, {"c": "ok"}, {"c": 3})
    assert resumed.finished and got["c"] == 28


def test_end_game_duplicates_a_slow_providers_chunk_and_first_copy_wins():
    plan = TransferPlan(2)
    plan.add_provider("slow")
    plan.add_provider("fast")
    assert plan.next_chunk("slow") == 0
    assert plan.next_chunk("fast") == 1
    assert plan.chunk_ok("fast", 1, 10)
    assert plan.next_chunk("fast") == 0  # duplicate of the slow one's chunk
    assert plan.chunk_ok("fast", 0, 10)
    assert plan.finished
    assert not plan.chunk_ok("slow", 0, 10)  # the late copy is not counted twice
    assert plan.received_by() == {"slow": 0, "fast": 20}


def test_end_game_duplicates_one_chunk_at_a_time_and_only_from_an_idle_provider():
    plan = TransferPlan(6)
    for p in ("a", "b"):
        plan.add_provider(p)
    assert [plan.next_chunk("a") for _ in range(3)] == [0, 1, 2]
    assert [plan.next_chunk("b") for _ in range(3)] == [3, 4, 5]
    assert plan.next_chunk("b") is None  # the queue is empty, and b still has chunks of its own on the way
    for i in (3, 4):
        plan.chunk_ok("b", i, 1)
    assert plan.next_chunk("b") is None  # chunk 5 still on its way
    plan.chunk_ok("b", 5, 1)
    assert plan.next_chunk("b") == 0 and plan.next_chunk("b") is None  # idle now: one duplicate at a time
    plan.chunk_ok("b", 0, 1)
    assert plan.next_chunk("b") == 1


def test_a_chunk_being_verified_is_not_duplicated_and_its_verdict_outlives_the_stream():
    plan = TransferPlan(2)
    for p in ("a", "b"):
        plan.add_provider(p)
    assert plan.next_chunk("a") == 0 and plan.next_chunk("a") == 1
    plan.chunk_received("a", 0)  # a's chunk 0 is in, being verified
    assert plan.next_chunk("b") == 1  # the end game duplicates only what is still on its way
    assert plan.next_chunk("b") is None
    plan.provider_failed("a")  # a's stream broke: chunk 1 is b's anyway, chunk 0 awaits its verdict
    assert plan.next_chunk("b") is None
    plan.chunk_bad("a", 0)  # the verdict: a lied; chunk 0 goes back to the queue
    assert plan.providers["a"].banned and plan.next_chunk("b") == 0
    assert plan.chunk_ok("b", 0, 10) and plan.chunk_ok("b", 1, 10) and plan.finished


def test_a_verified_chunk_of_a_failed_provider_still_counts():
    plan = TransferPlan(1)
    plan.add_provider("a")
    assert plan.next_chunk("a") == 0
    plan.chunk_received("a", 0)
    plan.provider_failed("a")
    assert plan.chunk_ok("a", 0, 7) and plan.finished and plan.received_by() == {"a": 7}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), kinds=st.lists(st.sampled_from(["ok", "liar", "dies@0", "dies@3", "dies@20"]), min_size=1,
                                           max_size=5), speeds=st.lists(st.integers(1, 4), min_size=5, max_size=5),
       seed=st.integers(0, 1000))
def test_plan_finishes_iff_an_honest_provider_lives(n, kinds, speeds, seed):
    behaviour = {f"p{i}": k for i, k in enumerate(kinds)}
    plan = TransferPlan(n, max_failures=2)
    got, _ = _simulate(plan, behaviour, {p: speeds[i] for i, p in enumerate(behaviour)}, seed=seed)
    if "ok" in kinds:
        assert plan.finished
    assert sum(got.values()) == len(plan.done)  # every chunk counted once
    assert all(got[p] == 0 for p, k in behaviour.items() if k == "liar")


def _record(step, mh, sh, *, serving=0, log=None):
    return ProviderRecord(step=step, manifest_hash=mh, state_hash=sh, total_bytes=10, time=1.0, serving=serving,
                          log=log or {})


def test_choose_state_prefers_support_then_newest_and_skips_untrusted():
    records = {"a": _record(5, H[1], H[2]), "b": _record(5, H[1], H[2]), "c": _record(6, H[3], H[4], serving=2),
               "d": _record(6, H[3], H[4]), "e": _record(6, H[3], H[4]), "f": _record(1, H[5], H[6])}
    choice = choose_state(records)
    assert (choice.step, choice.manifest_hash) == (6, H[3])
    assert choice.providers == ("d", "e", "c")  # idle ones first
    # a state the trainers do not report for its step is not fetched
    choice = choose_state(records, trusted_hashes={6: H[9]})
    assert (choice.step, choice.manifest_hash) == (5, H[1])
    # too old to count
    assert choose_state({"f": _record(1, H[5], H[6]), "g": _record(20, H[3], H[4])}).step == 20
    assert choose_state({}) is None


def test_log_sources_majority():
    records = {"a": _record(5, H[1], H[2], log={3: H[7], 4: H[8]}), "b": _record(5, H[1], H[2], log={4: H[8]}),
               "c": _record(5, H[1], H[2], log={4: H[9]})}
    assert log_sources(records, 4) == (H[8], ("a", "b"))
    assert log_sources(records, 3) == (H[7], ("a",))
    assert log_sources(records, 9) == (None, ())


def test_provider_record_round_trip_and_bad_input():
    r = _record(3, H[1], H[2], log={1: H[3], 2: H[4]})
    assert ProviderRecord.decode(r.encode()) == r
    for bad in (b"", b"\x81\xa4type\xa8provider", b"\xc1", b"\x91" * 100_000):
        with pytest.raises(RemoteProtocolError):
            ProviderRecord.decode(bad)
    from swarmrun.protocol.codec import pack, unpack

    d = unpack(r.encode())
    for key, value in (("manifest_hash", "x"), ("step", -1), ("log", [[1, "zz"]]), ("log", [[1, H[1]]] * 100),
                       ("time", float("nan")), ("keeper", 1)):
        with pytest.raises(RemoteProtocolError):
            ProviderRecord.decode(pack(dict(d, **{key: value})))


def test_messages_round_trip_and_bounds():
    for m in (Open(spec_hash=H[1], manifest_hash=H[2]), Get(index=5), Opened(size=10), Chunk(index=1, size=3),
              Refused(reason="busy", busy=True)):
        assert decode_message(m.encode()) == m
    from swarmrun.protocol.codec import pack

    for bad in (pack({"type": "chunk", "index": 1, "size": 2**40}), pack({"type": "opened", "size": 0}),
                pack({"type": "what"}), pack([1, 2]), pack({"type": "open", "version": 99, "spec_hash": H[1],
                                                             "manifest_hash": H[2]}), b"\x00" * 5000):
        with pytest.raises(RemoteProtocolError):
            decode_message(bad)
    with pytest.raises(RemoteProtocolError):
        header_length((10**6).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError):
        header_length(b"\x00\x00\x00\x00")
