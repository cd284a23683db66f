"""Error feedback on real hivemind averagers (``node/peer/feedback.py``): what each sender's encoding lost is
recorded slice by slice where that slice lies, for the slices it sends to the others and for its own reducer's.

Three 8-bit averagers of different weights: after a round each one's residual buffers hold exactly
``x - decode(encode(x))`` of its contribution, part by part in hivemind's partition of the group (the bits are
checked, not a tolerance), and every participant still holds the same averaged bits. The host side (which round a
carry goes into) is tested without peers in tests/unit/test_error_feedback.py.
"""

import pytest
import torch
from hivemind import DHT
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor

from swarmrun.node.peer import codecs
from swarmrun.node.peer.averaging import RoundAverager
from swarmrun.node.peer.feedback import ErrorFeedback
from swarmrun.protocol.cursor import DataCursor
from tests.integration.test_compressed_round import PART_BYTES, SHAPES, held, meta
from tests.integration.test_round_averager import run_round

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SPEC_HASH = "cd" * 32


@pytest.fixture
def three_with_feedback():
    codecs.install_codecs()
    made = []
    try:
        first = DHT(start=True)
        made.append(first)
        dhts = [first] + [DHT(start=True, initial_peers=first.get_visible_maddrs()) for _ in range(2)]
        made.extend(dhts[1:])
        gen = torch.Generator().manual_seed(1)
        averagers = []
        for dht in dhts:
            tensors = [torch.randn(*s, generator=gen) for s in SHAPES]
            avg = RoundAverager(tensors, dht, spec_hash=SPEC_HASH, prefix="test_feedback", start=True,
                                min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=3.0,
                                allreduce_timeout=10.0, part_size_bytes=PART_BYTES, target_group_size=3,
                                compression=codecs.make_codec("8bit"), feedback=ErrorFeedback(tensors))
            made.append(avg)
            averagers.append(avg)
        yield averagers
    finally:
        for obj in reversed(made):
            obj.shutdown()


def lost_by_encoding(tensors):
    """``x - decode(encode(x))`` of each part of ``tensors`` in hivemind's partition of a 3-peer group, as tensors."""
    codec = codecs.make_codec("8bit")
    container = TensorPartContainer(tensors, (1.0, 1.0, 1.0), compression=codec, part_size_bytes=PART_BYTES)
    flat = []
    for peer in range(3):
        for part, info in container._input_parts_by_peer[peer]:
            flat.append(torch.sub(part.float(), deserialize_torch_tensor(codec.compress(part, info)).float()))
    return list(torch.cat(flat).split([t.numel() for t in tensors]))


def test_each_sender_records_what_its_encoding_lost_where_each_slice_lies(three_with_feedback):
    averagers = three_with_feedback
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    before = [held(avg) for avg in averagers]
    outcomes = run_round(averagers, [meta(5, [0]), meta(5, [1, 2, 3, 4]), meta(5, [5, 6])], cursor)
    assert all(o.complete for o in outcomes), [o.reason for o in outcomes]
    after = [held(avg) for avg in averagers]
    for i in range(len(SHAPES)):
        assert torch.equal(after[0][i], after[1][i]) and torch.equal(after[0][i], after[2][i])
    for avg, x in zip(averagers, before):
        want = lost_by_encoding(x)
        got = avg.feedback.residuals  # shared with the averager process, which wrote them during the round
        for g, w, t in zip(got, want, x):
            assert torch.equal(g.flatten(), w), float((g.flatten() - w).abs().max())
            assert 0 < float(g.norm()) < 0.05 * float(t.norm())  # 8 bits lose a little of every tensor
