"""Data by block: a map-style task by index, a streaming task by (shard, offset range); the same cursor."""

import hashlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.node.tasks.base import ShardedTask, ShardMap
from swarmrun.protocol.errors import TaskError
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.plan import pick_blocks


def test_map_style_blocks_are_indices_of_get_batch():
    task = SyntheticTask({"num_examples": 21}, seed=3)
    x, y = task.batch_for_blocks([2, 0], block_size=8)  # block 2 is the short last one: indices 16..20
    ex, ey = task.get_batch([16, 17, 18, 19, 20, 0, 1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(x, ex) and torch.equal(y, ey)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.data())
def test_shard_map_pieces_cover_exactly_the_range(sizes, data):
    shards = ShardMap(tuple(sizes))
    n = shards.num_examples
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    flat = [(s, o) for s, size in enumerate(sizes) for o in range(size)]  # data index -> (shard, offset)
    pieces = shards.pieces(start, stop)
    assert [(s, o) for s, a, b in pieces for o in range(a, b)] == flat[start:stop]
    assert all(0 <= a < b <= sizes[s] for s, a, b in pieces)
    assert all(shards.locate(i) == flat[i] for i in range(n))


def test_a_block_is_one_shard_range_when_shards_hold_whole_blocks():
    shards = ShardMap((16, 8, 5))
    assert [shards.block_pieces(b, 8) for b in range(4)] == [[(0, 0, 8)], [(0, 8, 16)], [(1, 0, 8)], [(2, 0, 5)]]
    assert ShardMap((5, 5)).block_pieces(1, 4) == [(0, 4, 5), (1, 0, 3)]  # a block across a shard boundary
    for bad in ((), (0,), (3, -1), (2.0,)):
        with pytest.raises(TaskError):
            ShardMap(bad)


class Streams(ShardedTask):
    """Shards are generators (no random access); each example is (its global id, a feature)."""

    name, version = "test-streams", "1"

    def __init__(self, args, seed, sizes=(7, 5, 12), short=None):
        super().__init__(args, seed)
        self.sizes, self.short, self.opened = tuple(sizes), short, []

    def shard_sizes(self):
        return self.sizes

    def open_shard(self, shard):
        self.opened.append(shard)
        first = sum(self.sizes[:shard])
        count = self.sizes[shard] if shard != self.short else self.sizes[shard] - 1
        for i in range(first, first + count):
            yield torch.tensor(i), torch.tensor([float(i)] * 3)

    def data_fingerprint(self):
        return hashlib.sha256(repr(self.sizes).encode()).hexdigest()

    def build_model(self):
        return torch.nn.Linear(3, 1)

    def loss(self, model, batch):
        return model(batch[1]).pow(2).mean()


def test_streaming_task_reads_blocks_by_shard_and_the_cursor_is_the_same_object():
    task = Streams({}, seed=0)
    cursor = DataCursor.new(seed=9, num_examples=task.num_examples(), block_size=4,
                            data_fingerprint=task.data_fingerprint())
    seen = []
    for walk in itertools.count():  # two trainers walking one data epoch by the run's own block picker
        blocks = pick_blocks(cursor, 2, member=walk % 2, members=2, exclude=RangeSet())
        ids, x = task.batch_for_blocks(blocks, cursor.block_size)
        assert torch.equal(x[:, 0], ids.float())
        expected = [i for b in blocks for i in range(b * 4, min(b * 4 + 4, task.num_examples()))]
        assert ids.tolist() == expected
        seen += ids.tolist()
        cursor = cursor.apply(blocks)
        if cursor.data_epoch == 1:
            break
    assert sorted(seen) == list(range(24))  # every example once in the epoch
    assert cursor.summary()["blocks_duplicated"] == 0 and cursor.summary()["blocks_skipped"] == 0
    ids, _ = task.get_batch([3, 4, 5, 6, 7, 8, 1])  # evaluation path: any indices, across shards
    assert ids.tolist() == [3, 4, 5, 6, 7, 8, 1]


def test_a_shard_shorter_than_declared_is_refused():
    task = Streams({}, seed=0, short=1)
    with pytest.raises(TaskError, match=r"shard 1 gave 3 examples at \[1, 5\)"):
        task.batch_for_blocks([2], block_size=4)  # examples 8..11: shard 1, offsets 1..4, one missing
    with pytest.raises(TaskError, match="outside"):
        task.get_batch([24])
