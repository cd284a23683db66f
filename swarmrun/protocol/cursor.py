"""The data cursor: the run's position in its data order.

Examples are grouped into fixed-size blocks (the unit of data accounting). Each
data epoch walks the blocks in a seeded permutation; the cursor records which
blocks were applied in the current epoch, which were applied more than once, and
a summary of every closed epoch, so that a skipped or repeated block is counted
from the state itself (DESIGN invariant 2).
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmrun.protocol.codec import pack
from swarmrun.protocol.errors import IncompatibleState, LocalProtocolError, RemoteProtocolError

__all__ = ["RangeSet", "DataCursor", "block_order", "block_examples", "num_blocks"]

_HISTORY_KEYS = frozenset({"epoch", "applied", "skipped", "duplicated"})
_CURSOR_KEYS = frozenset({"seed", "num_examples", "block_size", "data_epoch", "applied", "duplicated", "history"})
# optional: a cursor written before it existed, or of a task without one, has no data fingerprint
_OPTIONAL_KEYS = frozenset({"data_fingerprint"})
_MAX_FINGERPRINT = 128
_MAX_INT = 2**63 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # the range msgpack carries, as in Spec.seed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RangeSet:
    """An immutable set of ints held as sorted, disjoint, non-adjacent ``[start, end)`` ranges.

    Raises:
        LocalProtocolError: ``ranges`` is not in that canonical form.
    """

    ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        try:
            ranges = tuple((start, end) for start, end in self.ranges)
        except (TypeError, ValueError):
            raise LocalProtocolError("ranges must be a sequence of (start, end) pairs") from None
        prev_end = None
        for start, end in ranges:
            if not (_is_int(start) and _is_int(end)) or start >= end:
                raise LocalProtocolError(f"range [{start!r}, {end!r}) is not a non-empty int range")
            # strictly greater: adjacent ranges must be merged, so that equal sets compare equal
            if prev_end is not None and start <= prev_end:
                raise LocalProtocolError("ranges must be sorted, disjoint and not adjacent")
            prev_end = end
        object.__setattr__(self, "ranges", ranges)

    @classmethod
    def from_items(cls, items: Iterable[int]) -> RangeSet:
        """Build the set of the given ints."""
        ranges: list[tuple[int, int]] = []
        for item in sorted(set(items)):
            if not _is_int(item):
                raise LocalProtocolError(f"{item!r} is not an int")
            if ranges and ranges[-1][1] == item:
                ranges[-1] = (ranges[-1][0], item + 1)
            else:
                ranges.append((item, item + 1))
        return cls(tuple(ranges))

    @classmethod
    def from_range(cls, start: int, end: int) -> RangeSet:
        """Build the set ``[start, end)`` (empty when ``end <= start``)."""
        return cls(((start, end),)) if end > start else cls()

    @classmethod
    def from_list(cls, data: Any) -> RangeSet:
        """Build from ``to_list()``'s form, received from a peer: non-negative, canonical.

        Raises:
            RemoteProtocolError: ``data`` is not a canonical list of ``[start, end]`` pairs.
        """
        if not isinstance(data, list):
            raise RemoteProtocolError("range set must be a list of [start, end] pairs")
        pairs = []
        for pair in data:
            if not isinstance(pair, list) or len(pair) != 2:
                raise RemoteProtocolError("range set must be a list of [start, end] pairs")
            if not (_is_int(pair[0]) and _is_int(pair[1])) or pair[0] < 0 or pair[1] > _MAX_INT:
                raise RemoteProtocolError(f"range {pair!r} is out of bounds")
            pairs.append((pair[0], pair[1]))
        try:
            return cls(tuple(pairs))
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"invalid range set: {exc}") from None

    def to_list(self) -> list[list[int]]:
        """Return the plain, msgpack-able form."""
        return [[start, end] for start, end in self.ranges]

    @property
    def is_empty(self) -> bool:
        """True when the set holds no int."""
        return not self.ranges

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __len__(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def __iter__(self) -> Iterator[int]:
        for start, end in self.ranges:
            yield from range(start, end)

    def __contains__(self, item: object) -> bool:
        if not _is_int(item):
            return False
        i = bisect.bisect_right(self.ranges, (item, _MAX_INT + 1)) - 1
        return i >= 0 and self.ranges[i][0] <= item < self.ranges[i][1]

    def add(self, other: RangeSet) -> RangeSet:
        """Return the union of both sets."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(self.ranges + other.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return RangeSet(tuple(merged))

    def intersect(self, other: RangeSet) -> RangeSet:
        """Return the ints in both sets."""
        out: list[tuple[int, int]] = []
        i = j = 0
        a, b = self.ranges, other.ranges
        while i < len(a) and j < len(b):
            start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if start < end:
                out.append((start, end))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return RangeSet(tuple(out))

    def subtract(self, other: RangeSet) -> RangeSet:
        """Return the ints of this set that are not in ``other``."""
        out: list[tuple[int, int]] = []
        j = 0
        b = other.ranges
        for start, end in self.ranges:
            while j < len(b) and b[j][1] <= start:
                j += 1
            k = j
            while start < end and k < len(b) and b[k][0] < end:
                if b[k][0] > start:
                    out.append((start, b[k][0]))
                start = max(start, b[k][1])
                k += 1
            if start < end:
                out.append((start, end))
        return RangeSet(tuple(out))


def num_blocks(num_examples: int, block_size: int) -> int:
    """Return the number of blocks of a data set (the last one may be short)."""
    if num_examples < 0 or block_size <= 0:
        raise LocalProtocolError("num_examples must be >= 0 and block_size > 0")
    return -(-num_examples // block_size)


def block_examples(block: int, block_size: int, num_examples: int) -> range:
    """Return the example indices of ``block`` (the last block may be short).

    Raises:
        LocalProtocolError: ``block`` is not a block of this data set.
    """
    if not 0 <= block < num_blocks(num_examples, block_size):
        raise LocalProtocolError(f"block {block} is out of range")
    return range(block * block_size, min((block + 1) * block_size, num_examples))


@functools.lru_cache(maxsize=8)
def _block_order(seed: int, data_epoch: int, num_blocks: int) -> tuple[int, ...]:
    order = list(range(num_blocks))
    # A str seed is hashed with sha512 by random.Random: stable across platforms and versions.
    random.Random(f"{seed}:{data_epoch}").shuffle(order)
    return tuple(order)


def block_order(seed: int, data_epoch: int, num_blocks: int) -> list[int]:
    """Return the deterministic permutation of block ids for one data epoch."""
    return list(_block_order(seed, data_epoch, num_blocks))


@dataclass(frozen=True, kw_only=True)
class DataCursor:
    """The run's position in its data order.

    ``applied`` and ``duplicated`` hold block ids of the current data epoch;
    ``history`` holds one ``dict(epoch=, applied=, skipped=, duplicated=)`` per
    closed epoch (counts of distinct blocks). ``data_fingerprint`` names the
    dataset the block ids count (empty: unknown), so a state of other data is
    refused rather than trained on. Construction validates consistency.

    Raises:
        LocalProtocolError: the fields are inconsistent.
    """

    seed: int
    num_examples: int
    block_size: int
    data_epoch: int = 0
    applied: RangeSet = field(default_factory=RangeSet)
    duplicated: RangeSet = field(default_factory=RangeSet)
    history: tuple = ()
    data_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.data_fingerprint, str) or len(self.data_fingerprint) > _MAX_FINGERPRINT:
            raise LocalProtocolError(f"cursor data_fingerprint must be a string of at most {_MAX_FINGERPRINT} chars")
        if not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise LocalProtocolError(f"cursor seed must be a 64-bit int, got {self.seed!r}")
        for name in ("num_examples", "block_size", "data_epoch"):
            value = getattr(self, name)
            if not _is_int(value) or abs(value) > _MAX_INT:
                raise LocalProtocolError(f"cursor field {name} must be a 63-bit int, got {value!r}")
        if self.num_examples <= 0 or self.block_size <= 0 or self.data_epoch < 0:
            raise LocalProtocolError("num_examples and block_size must be > 0, data_epoch >= 0")
        if not isinstance(self.applied, RangeSet) or not isinstance(self.duplicated, RangeSet):
            raise LocalProtocolError("applied and duplicated must be RangeSets")
        n = self.num_blocks
        if self.applied.ranges and (self.applied.ranges[0][0] < 0 or self.applied.ranges[-1][1] > n):
            raise LocalProtocolError(f"applied blocks are outside [0, {n})")
        if len(self.applied) == n:
            raise LocalProtocolError("every block is applied but the data epoch is not closed")
        if self.duplicated.subtract(self.applied):
            raise LocalProtocolError("duplicated blocks must be applied blocks")
        history = tuple(dict(entry) if isinstance(entry, Mapping) else entry for entry in self.history)
        if len(history) != self.data_epoch:
            raise LocalProtocolError(f"history has {len(history)} entries for data epoch {self.data_epoch}")
        for epoch, entry in enumerate(history):
            if not isinstance(entry, dict) or set(entry) != _HISTORY_KEYS:
                raise LocalProtocolError(f"history entry {epoch} must have keys {sorted(_HISTORY_KEYS)}")
            if not all(_is_int(v) and v >= 0 for v in entry.values()):
                raise LocalProtocolError(f"history entry {epoch} must hold non-negative ints")
            if entry["epoch"] != epoch or entry["applied"] + entry["skipped"] != n or entry["duplicated"] > entry["applied"]:
                raise LocalProtocolError(f"history entry {epoch} is inconsistent: {entry}")
        object.__setattr__(self, "history", history)

    def __hash__(self) -> int:
        # the generated hash would fail on the history dicts
        return hash(pack(self.to_dict()))

    @classmethod
    def new(cls, *, seed: int, num_examples: int, block_size: int, data_fingerprint: str = "") -> DataCursor:
        """Return the cursor of a new run: data epoch 0, nothing applied."""
        return cls(seed=seed, num_examples=num_examples, block_size=block_size, data_fingerprint=data_fingerprint)

    @property
    def num_blocks(self) -> int:
        """Blocks per data epoch."""
        return num_blocks(self.num_examples, self.block_size)

    def pending(self) -> RangeSet:
        """Return the blocks not yet applied in the current data epoch."""
        return RangeSet.from_range(0, self.num_blocks).subtract(self.applied)

    def next_blocks(
        self, count: int, *, exclude: RangeSet | Iterable[int] = RangeSet(), start_hint: int = 0
    ) -> list[int]:
        """Return up to ``count`` unapplied blocks not in ``exclude``, in data order.

        The walk over this epoch's permutation starts at position
        ``start_hint % num_blocks``, so peers with different hints take
        different blocks. Never crosses into the next data epoch.
        """
        if not isinstance(exclude, RangeSet):
            exclude = RangeSet.from_items(exclude)
        n = self.num_blocks
        order = _block_order(self.seed, self.data_epoch, n)
        out: list[int] = []
        start = start_hint % n
        for position in range(start, start + n):
            if len(out) >= count:
                break
            block = order[position % n]
            if block not in self.applied and block not in exclude:
                out.append(block)
        return out

    def apply(self, blocks: RangeSet | Iterable[int]) -> DataCursor:
        """Return the cursor advanced by ``blocks`` (block ids of the current data epoch).

        Blocks already applied are recorded in ``duplicated``. When every block of
        the epoch is applied, the epoch closes: its summary goes to ``history``,
        ``data_epoch`` grows by one and ``applied``/``duplicated`` start empty.

        Raises:
            LocalProtocolError: a block id is outside ``[0, num_blocks)``.
        """
        if not isinstance(blocks, RangeSet):
            blocks = RangeSet.from_items(blocks)
        n = self.num_blocks
        if blocks.ranges and (blocks.ranges[0][0] < 0 or blocks.ranges[-1][1] > n):
            raise LocalProtocolError(f"blocks {blocks.to_list()} are outside [0, {n})")
        applied = self.applied.add(blocks)
        duplicated = self.duplicated.add(self.applied.intersect(blocks))
        if len(applied) < n:
            return DataCursor(
                seed=self.seed, num_examples=self.num_examples, block_size=self.block_size,
                data_epoch=self.data_epoch, applied=applied, duplicated=duplicated, history=self.history,
                data_fingerprint=self.data_fingerprint,
            )
        closed = {"epoch": self.data_epoch, "applied": len(applied), "skipped": n - len(applied),
                  "duplicated": len(duplicated)}
        return DataCursor(
            seed=self.seed, num_examples=self.num_examples, block_size=self.block_size,
            data_epoch=self.data_epoch + 1, history=self.history + (closed,), data_fingerprint=self.data_fingerprint,
        )

    def samples_applied(self) -> int:
        """Examples of the blocks applied so far, over all data epochs: what a sample budget counts.

        A closed data epoch counts ``num_examples`` (less ``block_size`` per skipped block, which a cursor that
        only ``apply`` advanced never has); the current one counts its applied blocks (the dataset's last block
        may be short). A block applied twice counts once: ``blocks_duplicated`` reports that exception.
        """
        closed = sum(max(0, self.num_examples - h["skipped"] * self.block_size) for h in self.history)
        current = len(self.applied) * self.block_size
        last = self.num_blocks - 1
        if last in self.applied:  # the dataset's last block holds only what is left of the examples
            current -= last * self.block_size + self.block_size - self.num_examples
        return closed + current

    def summary(self) -> dict[str, int]:
        """Return counts for reports: totals over all epochs, pending in the current one."""
        return {
            "samples_applied": self.samples_applied(),
            "blocks_applied": sum(h["applied"] for h in self.history) + len(self.applied),
            "blocks_pending": self.num_blocks - len(self.applied),
            "blocks_skipped": sum(h["skipped"] for h in self.history),
            "blocks_duplicated": sum(h["duplicated"] for h in self.history) + len(self.duplicated),
            "data_epoch": self.data_epoch,
        }

    def to_dict(self) -> dict[str, Any]:
        """Return the plain, msgpack-able form (without ``data_fingerprint`` when it is empty, so a cursor
        of a state written before the field existed keeps its bytes and its state_hash)."""
        extra = {"data_fingerprint": self.data_fingerprint} if self.data_fingerprint else {}
        return {
            "seed": self.seed,
            "num_examples": self.num_examples,
            "block_size": self.block_size,
            "data_epoch": self.data_epoch,
            "applied": self.applied.to_list(),
            "duplicated": self.duplicated.to_list(),
            "history": [dict(h) for h in self.history],
            **extra,
        }

    @classmethod
    def from_dict(cls, d: Any) -> DataCursor:
        """Build a cursor from its plain form, validating everything.

        Raises:
            RemoteProtocolError: ``d`` is not a valid cursor.
        """
        if not isinstance(d, Mapping) or not _CURSOR_KEYS <= set(d) <= _CURSOR_KEYS | _OPTIONAL_KEYS:
            raise RemoteProtocolError(f"cursor must be a map with keys {sorted(_CURSOR_KEYS)} "
                                      f"(and optionally {sorted(_OPTIONAL_KEYS)})")
        if not isinstance(d["history"], list):
            raise RemoteProtocolError("cursor history must be a list")
        try:
            return cls(
                seed=d["seed"], num_examples=d["num_examples"], block_size=d["block_size"],
                data_epoch=d["data_epoch"], applied=RangeSet.from_list(d["applied"]),
                duplicated=RangeSet.from_list(d["duplicated"]), history=tuple(d["history"]),
                data_fingerprint=d.get("data_fingerprint", ""),
            )
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"invalid cursor: {exc}") from None

    def check_compatible(self, *, num_examples: int, block_size: int, data_fingerprint: str = "",
                         seed: int | None = None) -> None:
        """Check that this cursor counts the same data as a spec or a dataset.

        An empty ``data_fingerprint`` (here or given) is not compared: a cursor written before cursors held
        one is still accepted when its size and block size agree.

        Raises:
            IncompatibleState: the number of examples, the block size, the fingerprint or the seed differ.
        """
        if (self.num_examples, self.block_size) != (num_examples, block_size):
            raise IncompatibleState(
                f"data cursor counts {self.num_examples} examples in blocks of {self.block_size}, "
                f"but the dataset has {num_examples} examples in blocks of {block_size}"
            )
        if self.data_fingerprint and data_fingerprint and self.data_fingerprint != data_fingerprint:
            raise IncompatibleState(
                f"data cursor is of dataset {self.data_fingerprint[:12]}, but this dataset's fingerprint is "
                f"{data_fingerprint[:12]}: the state was trained on other data"
            )
        if seed is not None and self.seed != seed:
            raise IncompatibleState(f"data cursor walks the data order of seed {self.seed}, the run's seed is {seed}")

    def check_same_data(self, expected: DataCursor) -> None:
        """Check that this (received) cursor counts the same dataset, in the same order, as ``expected``
        (the cursor this peer builds from the spec and its own task).

        Raises:
            IncompatibleState: they differ in size, block size, fingerprint or seed.
        """
        self.check_compatible(num_examples=expected.num_examples, block_size=expected.block_size,
                              data_fingerprint=expected.data_fingerprint, seed=expected.seed)
