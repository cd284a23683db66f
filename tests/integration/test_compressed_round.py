"""The exact round with each codec, on real hivemind averagers on loopback: every participant holds the same bits.

Each part is encoded once by its sender (its own reducer's part too) and once by its reducer after averaging; every
participant, the reducer included, decodes those bytes. Two checks per codec:
- three senders of different weights end with bit-identical tensors, close to the weighted average, every value the
  decoding of a message (fp16/bf16 values are representable; an 8-bit part holds at most 256 distinct values);
- with one sender of weight > 0 (the others' claims refused: weight 0), every part is exactly
  ``decode(encode(decode(encode(part))))`` of that sender's part: its own reducer used the decoded bits of its
  contribution, not the raw ones, and the weights were the claim decision's.
"""

import pytest
import torch
from hivemind import DHT
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor

from swarmrun.node.peer import codecs
from swarmrun.node.peer.averaging import RoundAverager
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.round import RoundMeta
from swarmrun.protocol.spec import COMPRESSIONS
from tests.integration.test_round_averager import run_round

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SPEC_HASH = "cd" * 32
PART_BYTES = 4096  # several parts per reducer
SHAPES = ((6000,), (7, 13), (3000,))  # one tensor at least codecs.EIGHT_BIT_MIN_VALUES (8-bit), two below (fp16)
TOLERANCE = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2, "8bit": 0.1, "quantile8bit": 0.1}


@pytest.fixture(params=COMPRESSIONS)
def three_averagers(request):
    codecs.install_codecs()
    made = []
    try:
        first = DHT(start=True)
        made.append(first)
        dhts = [first] + [DHT(start=True, initial_peers=first.get_visible_maddrs()) for _ in range(2)]
        made.extend(dhts[1:])
        gen = torch.Generator().manual_seed(0)
        averagers = []
        for dht in dhts:
            avg = RoundAverager([torch.randn(*s, generator=gen) for s in SHAPES], dht, spec_hash=SPEC_HASH,
                                prefix=f"test_codec_{request.param}", start=True, min_matchmaking_time=1.0,
                                request_timeout=0.5, next_chunk_timeout=3.0, allreduce_timeout=10.0,
                                part_size_bytes=PART_BYTES, target_group_size=3,
                                compression=codecs.make_codec(request.param))
            made.append(avg)
            averagers.append(avg)
        yield request.param, averagers
    finally:
        for obj in reversed(made):
            obj.shutdown()


def held(avg):
    with avg.get_tensors() as tensors:
        return [t.clone() for t in tensors]


def meta(step, block, epoch=0):
    return RoundMeta(spec_hash=SPEC_HASH, step=step, samples=4 * len(block), blocks=RangeSet.from_items(block),
                     data_epoch=epoch)


def twice_through(codec, tensors):
    """Each part of ``tensors`` (hivemind's partition of a 3-peer group) encoded, decoded, encoded, decoded."""
    container = TensorPartContainer(tensors, (1.0, 1.0, 1.0), compression=codec, part_size_bytes=PART_BYTES)
    flat = []
    for peer in range(3):
        for part, info in container._input_parts_by_peer[peer]:
            once = deserialize_torch_tensor(codec.compress(part, info))
            flat.append(deserialize_torch_tensor(codec.compress(once, info)).float())
    flat = torch.cat(flat)
    return list(flat.split([t.numel() for t in tensors]))


def assert_decoded_values(name, tensor):
    if name == "fp16" or (name.endswith("8bit") and tensor.numel() < codecs.EIGHT_BIT_MIN_VALUES):
        assert torch.equal(tensor.half().float(), tensor)
    elif name == "bf16":
        assert torch.equal(tensor.bfloat16().float(), tensor)
    elif name.endswith("8bit"):  # parts of 4096 values: each its own codebook of 256
        for part in tensor.flatten().split(PART_BYTES):
            assert part.unique().numel() <= 256


def test_every_participant_holds_the_same_bits(three_averagers):
    name, averagers = three_averagers
    cursor = DataCursor.new(seed=1, num_examples=64, block_size=4)
    before = [held(avg) for avg in averagers]
    metas = [meta(5, [0]), meta(5, [1, 2, 3, 4]), meta(5, [5, 6])]  # weights 4, 16, 8
    outcomes = run_round(averagers, metas, cursor)
    assert all(o.complete for o in outcomes), [o.reason for o in outcomes]
    assert all(o.sent_bytes > 0 for o in outcomes)  # counted on the encoded messages
    after = [held(avg) for avg in averagers]
    for i in range(len(SHAPES)):
        expected = (4 * before[0][i].double() + 16 * before[1][i].double() + 8 * before[2][i].double()) / 28
        assert float((after[0][i].double() - expected).norm() / expected.norm()) < TOLERANCE[name]
        assert torch.equal(after[0][i], after[1][i]) and torch.equal(after[0][i], after[2][i])
        assert_decoded_values(name, after[0][i])

    # one sender of weight > 0: the others' claims are of another data epoch, refused (weight 0)
    codec = codecs.make_codec(name)
    expected = twice_through(codec, after[0])
    outcomes = run_round(averagers, [meta(6, [0]), meta(6, [1], epoch=1), meta(6, [2], epoch=1)], cursor)
    assert all(o.complete for o in outcomes), [o.reason for o in outcomes]
    assert sorted(outcomes[0].weights) == [0.0, 0.0, 4.0]
    for avg in averagers:
        for got, want in zip(held(avg), expected):
            assert torch.equal(got.flatten(), want), (name, float((got.flatten() - want).abs().max()))
