"""The round on real hivemind averagers on loopback: exact, sample-weighted, identical bits everywhere."""

import dataclasses

import pytest
import torch
from hivemind import DHT

from swarmrun.node.peer.averaging import RoundAverager
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.round import RoundMeta, claim_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s
SPEC_HASH = "cd" * 32


@pytest.fixture
def two_averagers():
    made = []
    try:
        dht1 = DHT(start=True)
        made.append(dht1)
        dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
        made.append(dht2)
        averagers = []
        gen = torch.Generator().manual_seed(0)
        for dht in (dht1, dht2):
            tensors = [torch.randn(1000, generator=gen), torch.randn(7, 13, generator=gen)]
            avg = RoundAverager(tensors, dht, spec_hash=SPEC_HASH, prefix="test_round", start=True,
                                min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=3.0,
                                allreduce_timeout=10.0, part_size_bytes=1024, target_group_size=2)
            made.append(avg)
            averagers.append(avg)
        yield averagers
    finally:
        for obj in reversed(made):
            obj.shutdown()


def declared(avg, meta: RoundMeta) -> RoundMeta:
    """The meta an honest peer sends: with the norm of what it averages."""
    with avg.get_tensors() as tensors:
        norm = float(torch.cat([t.flatten() for t in tensors]).norm())
    return dataclasses.replace(meta, grad_norm=norm)


def run_round(averagers, metas, cursor):
    controls = []
    metas = [declared(avg, meta) if meta.grad_norm == 0 else meta for avg, meta in zip(averagers, metas)]
    for avg, meta in zip(averagers, metas):
        avg.prepare_round(meta.step, cursor)
        controls.append(avg.step(gather=meta.encode(), weight=1.0, timeout=30, wait=False))
    return [c.result(timeout=40) for c in controls]


def test_sample_weighted_exact_average_with_batch_sizes_4_and_16(two_averagers):
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    claims = [RangeSet.from_items([0]), RangeSet.from_items([1, 2, 3, 4])]  # 4 and 16 samples
    metas = [RoundMeta(spec_hash=SPEC_HASH, step=5, samples=claim_samples(c, cursor), blocks=c, data_epoch=0)
             for c in claims]
    assert [m.samples for m in metas] == [4, 16]
    before = []
    for avg in two_averagers:
        with avg.get_tensors() as tensors:
            before.append([t.clone() for t in tensors])
    outcomes = run_round(two_averagers, metas, cursor)
    assert all(o.complete for o in outcomes), [o.reason for o in outcomes]
    assert outcomes[0].group_id == outcomes[1].group_id
    after = []
    for avg in two_averagers:
        with avg.get_tensors() as tensors:
            after.append([t.clone() for t in tensors])
    for i in range(2):
        expected = (4 * before[0][i].double() + 16 * before[1][i].double()) / 20
        torch.testing.assert_close(after[0][i].double(), expected, rtol=1e-6, atol=1e-6)
        # exact averaging: every participant holds the same bits
        assert torch.equal(after[0][i], after[1][i])
        assert not torch.equal(after[0][i], before[0][i])


def test_a_participant_at_another_step_is_refused_before_any_tensor_moves(two_averagers):
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    metas = [RoundMeta(spec_hash=SPEC_HASH, step=s, samples=4, blocks=RangeSet.from_items([b]), data_epoch=0)
             for s, b in ((1, 0), (2, 1))]
    before = []
    for avg in two_averagers:
        with avg.get_tensors() as tensors:
            before.append([t.clone() for t in tensors])
    controls = []
    for avg, meta in zip(two_averagers, metas):
        avg.prepare_round(meta.step, cursor)
        controls.append(avg.step(gather=meta.encode(), weight=1.0, timeout=4, wait=False, allow_retries=False))
    for c in controls:
        with pytest.raises(Exception):
            c.result(timeout=20)
    for avg, old in zip(two_averagers, before):
        with avg.get_tensors() as tensors:
            assert all(torch.equal(t, o) for t, o in zip(tensors, old))


def test_a_sender_exceeding_its_declared_norm_is_dropped_and_refused_next(two_averagers):
    """A hostile sender declares a small gradient norm and sends huge values: reducers drop it, the round is
    incomplete (nobody commits it), and the next rounds refuse the sender before any tensor moves."""
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    honest, hostile = two_averagers
    with hostile.get_tensors() as tensors:
        for t in tensors:
            t.mul_(1e6)
    metas = [declared(honest, RoundMeta(spec_hash=SPEC_HASH, step=3, samples=4, blocks=RangeSet.from_items([0]),
                                        data_epoch=0)),
             RoundMeta(spec_hash=SPEC_HASH, step=3, samples=4, blocks=RangeSet.from_items([1]), data_epoch=0,
                       grad_norm=1.0)]
    outcomes = run_round(two_averagers, metas, cursor)
    assert not any(o.complete for o in outcomes), outcomes
    with honest.get_tensors() as tensors:
        kept = [t.clone() for t in tensors]
    controls = []
    for avg, meta in zip(two_averagers, metas):
        avg.prepare_round(4, cursor)
        controls.append(avg.step(gather=dataclasses.replace(meta, step=4).encode(), weight=1.0, timeout=4, wait=False,
                                 allow_retries=False))
    # the suspect is refused at admission in the next rounds: the honest peer ends in no group (it raises), or the
    # suspect's own group is incomplete; no tensor of the honest peer moved
    with pytest.raises(Exception):
        controls[0].result(timeout=20)
    try:
        assert not controls[1].result(timeout=20).complete
    except AssertionError:
        raise
    except Exception:
        pass
    with honest.get_tensors() as tensors:
        assert all(torch.equal(t, k) for t, k in zip(tensors, kept))


def test_a_non_finite_sender_is_dropped(two_averagers):
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    honest, hostile = two_averagers
    with hostile.get_tensors() as tensors:
        tensors[0][3] = float("nan")
    metas = [declared(avg, RoundMeta(spec_hash=SPEC_HASH, step=1, samples=4, blocks=RangeSet.from_items([b]),
                                     data_epoch=0)) for avg, b in zip(two_averagers, (0, 1))]
    metas[1] = dataclasses.replace(metas[1], grad_norm=10.0)  # NaN norm is not a number it can declare
    outcomes = run_round(two_averagers, metas, cursor)
    assert not any(o.complete for o in outcomes), outcomes


def test_an_averager_process_that_died_holding_the_tensors_lock_is_reported_not_waited_for():
    """A signal to the whole process group can kill hivemind's averager process inside a round, with the averaged
    tensors' lock held: the host's ``get_tensors`` raised nothing and froze its event loop until a SIGKILL."""
    import multiprocessing
    import os
    import signal

    from swarmrun.node.peer.averaging import AveragerGone

    dht = DHT(start=True)
    avg = RoundAverager([torch.zeros(8)], dht, spec_hash=SPEC_HASH, prefix="test_gone", start=True)
    try:
        with avg.get_tensors() as tensors:  # a live averager: the lock is taken and given back
            assert tensors[0].shape == (8,)
        holder = multiprocessing.get_context("fork").Process(target=avg.lock_averaged_tensors.acquire)
        holder.start()  # takes the lock and exits without releasing it, as the killed averager did
        holder.join(10)
        os.kill(avg.pid, signal.SIGKILL)
        avg.join(10)
        with pytest.raises(AveragerGone):
            with avg.get_tensors():
                pass
    finally:
        if avg.is_alive():
            avg.shutdown()
        dht.shutdown()
