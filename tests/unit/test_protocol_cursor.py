"""Tests of swarmrun.protocol.cursor: RangeSet algebra and the data cursor."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet, block_examples, block_order, num_blocks
from swarmrun.protocol.errors import IncompatibleState, LocalProtocolError, RemoteProtocolError

FAST = settings(max_examples=200, deadline=None)
int_sets = st.sets(st.integers(0, 60), max_size=40)


@FAST
@given(int_sets, int_sets)
def test_rangeset_matches_python_sets(a, b):
    ra, rb = RangeSet.from_items(a), RangeSet.from_items(b)
    assert set(ra) == a and len(ra) == len(a) and ra.is_empty == (not a)
    assert set(ra.add(rb)) == a | b
    assert set(ra.intersect(rb)) == a & b
    assert set(ra.subtract(rb)) == a - b
    assert all((i in ra) == (i in a) for i in range(-1, 62))
    # canonical form: equal sets are equal objects
    assert ra.add(rb) == RangeSet.from_items(a | b) == rb.add(ra)
    assert RangeSet.from_list(unpack(pack(ra.to_list()))) == ra


def test_rangeset_canonical_form():
    assert RangeSet.from_items([1, 2, 3, 7]).ranges == ((1, 4), (7, 8))
    assert RangeSet.from_range(5, 5) == RangeSet()
    for bad in (((3, 1),), ((1, 3), (2, 5)), ((1, 3), (3, 5)), ((5, 6), (1, 2)), ((1.0, 2),)):
        with pytest.raises(LocalProtocolError):
            RangeSet(bad)


@pytest.mark.parametrize("bad", [[[3, 1]], [[1, 3], [3, 5]], [[-1, 2]], [[1, 2, 3]], [(1, 2)], "x", [[True, 2]], [[0, 2**64]]])
def test_rangeset_from_list_rejects(bad):
    with pytest.raises(RemoteProtocolError):
        RangeSet.from_list(bad)


def test_blocks():
    assert num_blocks(10, 3) == 4 and num_blocks(9, 3) == 3
    assert block_examples(3, 3, 10) == range(9, 10)
    assert block_examples(0, 3, 10) == range(0, 3)
    with pytest.raises(LocalProtocolError):
        block_examples(4, 3, 10)


def test_block_order_deterministic_permutation():
    order = block_order(7, 0, 50)
    assert sorted(order) == list(range(50))
    assert order == block_order(7, 0, 50)
    assert order != block_order(7, 1, 50) and order != block_order(8, 0, 50)
    # pinned, so a change of algorithm (which would reorder every run's data) is noticed
    assert block_order(1, 0, 8) == [5, 1, 0, 3, 4, 7, 2, 6]


def test_next_blocks_hints_and_exclusions():
    cursor = DataCursor.new(seed=3, num_examples=100, block_size=10)
    order = block_order(3, 0, 10)
    assert cursor.next_blocks(3) == order[:3]
    assert cursor.next_blocks(3, start_hint=5) == order[5:8]
    assert cursor.next_blocks(3, start_hint=15) == order[5:8]
    assert cursor.next_blocks(3, exclude=RangeSet.from_items(order[:2])) == order[2:5]
    advanced = cursor.apply(RangeSet.from_items(order[1:9]))
    assert advanced.next_blocks(5, start_hint=4) == [order[9], order[0]]
    assert cursor.next_blocks(0) == []


def test_apply_closes_epoch_and_records_duplicates():
    cursor = DataCursor.new(seed=1, num_examples=25, block_size=10)  # 3 blocks, last short
    cursor = cursor.apply(RangeSet.from_items([0]))
    cursor = cursor.apply(RangeSet.from_items([0, 1]))
    assert cursor.duplicated == RangeSet.from_items([0]) and cursor.data_epoch == 0
    assert cursor.pending() == RangeSet.from_items([2])
    cursor = cursor.apply([2])
    assert cursor.data_epoch == 1 and cursor.applied.is_empty and cursor.duplicated.is_empty
    assert cursor.history == ({"epoch": 0, "applied": 3, "skipped": 0, "duplicated": 1},)
    assert cursor.summary() == {"blocks_applied": 3, "blocks_pending": 3, "blocks_skipped": 0,
                                "blocks_duplicated": 1, "data_epoch": 1, "samples_applied": 25}
    with pytest.raises(LocalProtocolError):
        cursor.apply(RangeSet.from_items([3]))


ops = st.lists(st.sets(st.integers(0, 9), max_size=5), max_size=30)


@FAST
@given(st.integers(1, 10), ops)
def test_any_sequence_of_applies(block_size, steps):
    num_examples = 95
    n = num_blocks(num_examples, block_size)
    cursor = DataCursor.new(seed=5, num_examples=num_examples, block_size=block_size)
    applied, duplicated, epochs, total_dup = set(), set(), 0, 0
    for step in steps:
        blocks = {b % n for b in step}
        cursor = cursor.apply(RangeSet.from_items(blocks))
        duplicated |= blocks & applied
        applied |= blocks
        if len(applied) == n:  # the epoch closes exactly when all blocks are applied
            total_dup += len(duplicated)
            applied, duplicated, epochs = set(), set(), epochs + 1
        assert cursor.data_epoch == epochs
        assert set(cursor.applied) == applied and set(cursor.duplicated) == duplicated
        assert len(cursor.applied) < n
        summary = cursor.summary()
        assert summary["blocks_applied"] == epochs * n + len(applied)
        assert summary["blocks_duplicated"] == total_dup + len(duplicated)
        assert summary["blocks_pending"] == n - len(applied) and summary["blocks_skipped"] == 0
    assert DataCursor.from_dict(unpack(pack(cursor.to_dict()))) == cursor


@FAST
@given(st.integers(0, 2**32), st.integers(1, 7), st.integers(0, 50))
def test_next_blocks_walk_covers_the_epoch(seed, claim, hint):
    cursor = DataCursor.new(seed=seed, num_examples=40, block_size=3)
    seen = []
    while cursor.data_epoch == 0:
        blocks = cursor.next_blocks(claim, start_hint=hint)
        assert blocks and not set(blocks) & set(cursor.applied)
        seen += blocks
        cursor = cursor.apply(blocks)
    assert sorted(seen) == list(range(cursor.num_blocks))
    assert cursor.summary()["blocks_duplicated"] == 0


def test_check_compatible():
    cursor = DataCursor.new(seed=1, num_examples=100, block_size=10)
    cursor.check_compatible(num_examples=100, block_size=10)
    with pytest.raises(IncompatibleState, match="blocks of 10"):
        cursor.check_compatible(num_examples=100, block_size=20)
    with pytest.raises(IncompatibleState):
        cursor.check_compatible(num_examples=99, block_size=10)


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("seed"),
    lambda d: d.update(seed="1"),
    lambda d: d.update(block_size=0),
    lambda d: d.update(applied=[[0, 11]]),  # beyond num_blocks
    lambda d: d.update(applied=[[0, 10]]),  # all applied but epoch not closed
    lambda d: d.update(duplicated=[[5, 6]]),  # duplicated but not applied
    lambda d: d.update(data_epoch=1),  # no history for epoch 0
    lambda d: d.update(data_epoch=1, history=[{"epoch": 0, "applied": 9, "skipped": 0, "duplicated": 0}]),
    lambda d: d.update(data_epoch=1, history=[{"epoch": 0, "applied": 10, "skipped": 0}]),
    lambda d: d.update(history={}),
    lambda d: d.update(data_epoch=2**70),
])
def test_from_dict_rejects(mutate):
    d = DataCursor.new(seed=1, num_examples=100, block_size=10).apply(RangeSet.from_items([0, 1])).to_dict()
    mutate(d)
    with pytest.raises(RemoteProtocolError):
        DataCursor.from_dict(d)


@FAST
@given(st.dictionaries(st.sampled_from(["seed", "num_examples", "block_size", "data_epoch", "applied",
                                        "duplicated", "history", "x"]),
                       st.none() | st.integers(-5, 2**70) | st.lists(st.lists(st.integers(-2, 12), max_size=3), max_size=3)
                       | st.lists(st.dictionaries(st.text(max_size=9), st.integers(-1, 11)), max_size=2)))
def test_from_dict_random_input_only_remote_protocol_error(d):
    try:
        DataCursor.from_dict(d)
    except RemoteProtocolError:
        pass


def test_fingerprint_travels_and_a_cursor_of_other_data_is_refused():
    mine = DataCursor.new(seed=1, num_examples=100, block_size=10, data_fingerprint="f" * 64)
    moved = mine.apply(RangeSet.from_items(range(10)))  # an epoch closes: the fingerprint stays
    assert moved.data_fingerprint == mine.data_fingerprint
    received = DataCursor.from_dict(unpack(pack(moved.to_dict())))
    assert received == moved
    received.check_same_data(mine)
    other_data = DataCursor.new(seed=1, num_examples=100, block_size=10, data_fingerprint="e" * 64)
    with pytest.raises(IncompatibleState, match="other data"):
        other_data.check_same_data(mine)
    with pytest.raises(IncompatibleState, match="99 examples"):
        DataCursor.new(seed=1, num_examples=100, block_size=10).check_same_data(
            DataCursor.new(seed=1, num_examples=99, block_size=10))
    with pytest.raises(IncompatibleState, match="seed"):
        DataCursor.new(seed=2, num_examples=100, block_size=10).check_same_data(mine)
    # a cursor written before cursors held a fingerprint: same bytes as before, accepted on size alone
    legacy = DataCursor.new(seed=1, num_examples=100, block_size=10)
    assert "data_fingerprint" not in legacy.to_dict()
    legacy.check_same_data(mine)


def test_from_dict_rejects_a_bad_fingerprint():
    d = DataCursor.new(seed=1, num_examples=100, block_size=10).to_dict()
    for bad in (5, "x" * 129, None):
        with pytest.raises(RemoteProtocolError):
            DataCursor.from_dict({**d, "data_fingerprint": bad})
