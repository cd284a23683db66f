"""Snapshots, sans-IO: the snapshot record, owner-signed amendments and pause records, and the decisions
of who writes a snapshot and when (pure functions with an injected clock).

A snapshot store holds ``chunks/<digest>`` (content-addressed, shared between snapshots) and one record
per snapshot, ``snapshots/<step>.snapshot``, written last: the record holds the manifest, the run's
signed spec and the spec's amendment history, so a snapshot depends on nothing of the swarm that wrote it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.errors import IncompatibleState, RemoteProtocolError, UsageError
from swarmrun.protocol.manifest import MAX_MANIFEST_SIZE, Manifest
from swarmrun.protocol.spec import BUDGET_HPARAMS

__all__ = [
    "SNAPSHOT_VERSION", "SnapshotRecord", "Amendment", "PauseRecord", "PauseNote", "AMENDABLE",
    "parse_store_ref", "record_path", "step_of_record_path", "retained", "writer_candidates", "elect_writer", "PauseTurn", "decide_pause_turn",
    "young_daly_interval", "trainer_notes", "estimate_mtbf", "SnapshotPolicy", "decide_snapshot", "pause_key", "paused_key",
    "history_key", "parse_every", "SnapshotDecision", "amend_changes", "FailureWatch",
]

SNAPSHOT_VERSION = 1
MAX_RECORD_SIZE = MAX_MANIFEST_SIZE + (4 << 20)
MAX_HISTORY = 1000
#: hyperparameters a move may change (``--resume-from ... --set``); task, data and block size never change
AMENDABLE = ("lr", "target_batch_size", "total_steps", "total_samples", "epochs")  # a budget replaces the run's
RECORDS_DIR = "snapshots"
CHUNKS_DIR = "chunks"
_RECORD_NAME = re.compile(r"(\d{12})\.snapshot")
_STEP_SUFFIX = re.compile(r"^(.*)@(\d+)$")


def pause_key(run_id: str) -> str:
    """The owner's signed ``PauseRecord`` of the run."""
    return f"swarmrun.{run_id}.pause"


def paused_key(run_id: str) -> str:
    """Subkey per peer: its ``PauseNote`` (the snapshot it wrote, or that it left)."""
    return f"swarmrun.{run_id}.paused"


def history_key(run_id: str) -> str:
    """The run's amendment history (msgpack list of encoded ``Amendment``), kept by its peers."""
    return f"swarmrun.{run_id}.history"


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise RemoteProtocolError(what)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class Amendment:
    """An owner-signed change of a run's hyperparameters, taken at ``step`` (e.g. when a run moves).

    The signature (by the spec's ``owner_key``) covers ``unsigned_bytes()``; ``from_spec``/``to_spec``
    are the spec hashes before and after, so a history is a chain.
    """

    step: int
    from_spec: str
    to_spec: str
    changes: Mapping[str, Any]
    time: float
    signature: bytes = b""

    def unsigned_bytes(self) -> bytes:
        return pack(dict(type="amendment", version=SNAPSHOT_VERSION, step=self.step, from_spec=self.from_spec,
                         to_spec=self.to_spec, changes=dict(self.changes), time=self.time))

    def encode(self) -> bytes:
        return pack(dict(unsigned=self.unsigned_bytes(), signature=self.signature))

    @classmethod
    def decode(cls, data: bytes) -> "Amendment":
        d = unpack(data, max_size=1 << 16)
        _need(isinstance(d, dict) and set(d) == {"unsigned", "signature"}, "amendment must be {unsigned, signature}")
        _need(isinstance(d["unsigned"], bytes) and isinstance(d["signature"], bytes), "amendment fields are bytes")
        u = unpack(d["unsigned"], max_size=1 << 16)
        _need(isinstance(u, dict) and u.get("type") == "amendment" and u.get("version") == SNAPSHOT_VERSION,
              "not an amendment of this version")
        _need(_is_int(u.get("step")) and u["step"] >= 0, "amendment step")
        _need(isinstance(u.get("changes"), dict) and set(u["changes"]) <= set(AMENDABLE), "amendment changes")
        _need(all(isinstance(u.get(k), str) and len(u[k]) == 64 for k in ("from_spec", "to_spec")), "spec hashes")
        _need(isinstance(u.get("time"), (int, float)), "amendment time")
        return cls(step=u["step"], from_spec=u["from_spec"], to_spec=u["to_spec"], changes=u["changes"],
                   time=float(u["time"]), signature=d["signature"])

    def verify(self, owner_key: bytes, verifier: Callable[[bytes, bytes, bytes], bool]) -> None:
        """Raises IncompatibleState unless the run's owner signed it."""
        if verifier(owner_key, self.unsigned_bytes(), self.signature) is not True:
            raise IncompatibleState(f"amendment at step {self.step} is not signed by the run's owner")


@dataclass(frozen=True, kw_only=True)
class SnapshotRecord:
    """What a snapshot's record file holds: the manifest (its chunks are in the store), the run's signed spec
    (encoded ``SignedSpec``), the amendment history (encoded ``Amendment``s, oldest first) and who wrote it."""

    manifest: Manifest
    signed_spec: bytes
    history: tuple[bytes, ...] = ()
    writer: str = ""
    written_at: float = 0.0

    def encode(self) -> bytes:
        return pack(dict(type="snapshot", version=SNAPSHOT_VERSION, manifest=self.manifest.encode(),
                         signed_spec=self.signed_spec, history=list(self.history), writer=self.writer,
                         written_at=float(self.written_at)))

    @classmethod
    def decode(cls, data: bytes) -> "SnapshotRecord":
        """Raises RemoteProtocolError on any fault (a truncated or foreign file included)."""
        d = unpack(data, max_size=MAX_RECORD_SIZE)
        _need(isinstance(d, dict) and d.get("type") == "snapshot", "not a swarmrun snapshot record")
        _need(d.get("version") == SNAPSHOT_VERSION, f"snapshot version {d.get('version')!r} is not supported")
        _need(isinstance(d.get("manifest"), bytes) and isinstance(d.get("signed_spec"), bytes), "record fields")
        history = d.get("history")
        _need(isinstance(history, list) and len(history) <= MAX_HISTORY and all(isinstance(h, bytes) for h in history),
              "record history")
        _need(isinstance(d.get("writer"), str) and isinstance(d.get("written_at"), (int, float)), "record writer")
        return cls(manifest=Manifest.decode(d["manifest"]), signed_spec=d["signed_spec"], history=tuple(history),
                   writer=d["writer"], written_at=float(d["written_at"]))


@dataclass(frozen=True, kw_only=True)
class PauseRecord:
    """The owner's request that the swarm snapshot at ``at_step`` and leave (signed; peers verify it)."""

    run_id: str
    spec_hash: str
    at_step: int
    store: str = ""  # where to write; "" = the peers' own --snapshot-to
    time: float = 0.0
    signature: bytes = b""

    def unsigned_bytes(self) -> bytes:
        return pack(dict(type="pause", version=SNAPSHOT_VERSION, run_id=self.run_id, spec_hash=self.spec_hash,
                         at_step=self.at_step, store=self.store, time=self.time))

    def encode(self) -> bytes:
        return pack(dict(unsigned=self.unsigned_bytes(), signature=self.signature))

    @classmethod
    def decode(cls, data: bytes) -> "PauseRecord":
        d = unpack(data, max_size=1 << 14)
        _need(isinstance(d, dict) and set(d) == {"unsigned", "signature"}, "pause must be {unsigned, signature}")
        _need(isinstance(d["unsigned"], bytes) and isinstance(d["signature"], bytes), "pause fields are bytes")
        u = unpack(d["unsigned"], max_size=1 << 13)
        _need(isinstance(u, dict) and u.get("type") == "pause" and u.get("version") == SNAPSHOT_VERSION, "not a pause")
        _need(isinstance(u.get("run_id"), str) and isinstance(u.get("spec_hash"), str), "pause run")
        _need(_is_int(u.get("at_step")) and u["at_step"] >= 0, "pause step")
        _need(isinstance(u.get("store"), str) and len(u["store"]) < 4096, "pause store")
        _need(isinstance(u.get("time"), (int, float)), "pause time")
        return cls(run_id=u["run_id"], spec_hash=u["spec_hash"], at_step=u["at_step"], store=u["store"],
                   time=float(u["time"]), signature=d["signature"])

    def verify(self, owner_key: bytes, verifier: Callable[[bytes, bytes, bytes], bool]) -> bool:
        """True when the run's owner signed it."""
        try:
            return verifier(owner_key, self.unsigned_bytes(), self.signature) is True
        except Exception:
            return False


@dataclass(frozen=True, kw_only=True)
class PauseNote:
    """A peer's answer to a pause: the snapshot it wrote (``where`` is ``STORE@STEP``) and/or that it left."""

    step: int
    left: bool = False
    where: str = ""
    state_hash: str = ""
    manifest_hash: str = ""
    error: str = ""

    def encode(self) -> bytes:
        return pack(dict(type="paused", version=SNAPSHOT_VERSION, step=self.step, left=self.left, where=self.where,
                         state_hash=self.state_hash, manifest_hash=self.manifest_hash, error=self.error))

    @classmethod
    def decode(cls, data: bytes) -> "PauseNote":
        d = unpack(data, max_size=1 << 13)
        _need(isinstance(d, dict) and d.get("type") == "paused" and d.get("version") == SNAPSHOT_VERSION, "not a note")
        _need(_is_int(d.get("step")) and isinstance(d.get("left"), bool), "note step")
        for k in ("where", "state_hash", "manifest_hash", "error"):
            _need(isinstance(d.get(k), str) and len(d[k]) < 4096, f"note {k}")
        return cls(step=d["step"], left=d["left"], where=d["where"], state_hash=d["state_hash"],
                   manifest_hash=d["manifest_hash"], error=d["error"])


# ---- store layout -------------------------------------------------------------------------------------
def parse_store_ref(ref: str) -> tuple[str, Optional[int]]:
    """``STORE`` or ``STORE@STEP`` -> (store, step or None).

    Raises:
        UsageError: an empty store.
    """
    m = _STEP_SUFFIX.match(ref or "")
    store, step = (m.group(1), int(m.group(2))) if m else (ref, None)
    if not store:
        raise UsageError(f"a snapshot store must be a directory or an fsspec URL, got {ref!r}")
    return store, step


def record_path(step: int) -> str:
    """The record's path inside a store (zero-padded, so names sort by step)."""
    return f"{RECORDS_DIR}/{step:012d}.snapshot"


def step_of_record_path(name: str) -> Optional[int]:
    m = _RECORD_NAME.fullmatch(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def retained(steps: Iterable[int], keep: int) -> tuple[list[int], list[int]]:
    """Retention keep-last-K: (kept, dropped) steps, newest first / any order."""
    ordered = sorted(set(steps), reverse=True)
    keep = max(1, keep)
    return ordered[:keep], ordered[keep:]


# ---- who writes, and when ---------------------------------------------------------------------------
def writer_candidates(stores: Mapping[str, bool], me: str, *, i_write: bool, pause_store: str = "") -> list[str]:
    """The live trainers that can write the run's snapshot, in election order (lowest peer id first).

    Args:
        stores: each live trainer's peer id -> whether it reports a snapshot store (``--snapshot-to``).
        i_write: this peer has a store (its own report may not be in ``stores`` yet).
        pause_store: a pause's ``--to``: every trainer can write there, so every one is a candidate.
    A peer without a store is never elected: electing one lost a paused run's 66 steps once (it had nowhere to
    write, and the others stopped anyway)."""
    if pause_store:
        return sorted(set(stores) | {me})
    return sorted({p for p, has in stores.items() if has} | ({me} if i_write else set()))


def elect_writer(candidates: Iterable[str]) -> Optional[str]:
    """The elected writer: the first candidate (lowest peer id). Every peer computes it from its view of the same
    progress reports; a brief disagreement makes two writers of the same state, which the content-addressed store
    makes harmless. None when no peer can write."""
    return min(candidates, default=None)


@dataclass(frozen=True)
class PauseTurn:
    """What a stopped peer does next while a pause's snapshot is not yet durable."""

    action: str  # "leave": a snapshot of this step exists; "write": write it now; "wait": another writes it
    reason: str


def decide_pause_turn(*, now: float, since: float, me: str, candidates: Sequence[str], trainers: Iterable[str],
                      notes: Mapping[str, PauseNote], step: int, takeover_s: float) -> PauseTurn:
    """A paused peer leaves only once a durable snapshot of a step at least its own exists (a pause must never cost
    committed steps). Candidates write in election order; the one at position k writes once every peer before it
    failed (its note says so), or after ``k * takeover_s`` seconds without a snapshot while none of them says it is
    writing. Peers without a store of their own come after every candidate (they write to their state dir).

    Args:
        since: when this peer stopped. notes: the pause notes published so far, by peer id; a note of an older
            step (an earlier pause) counts for nothing. A note with neither ``where`` nor ``error`` and not ``left``
            says its writer is writing.
    Returns:
        "leave", "write", "wait", or "give_up" when every peer in the order (this one included) failed to write.
    """
    current = {p: n for p, n in notes.items() if n.step >= step}
    durable = sorted((n for n in current.values() if n.where), key=lambda n: n.step)
    if durable:
        return PauseTurn("leave", f"a snapshot of step {durable[0].step} exists: {durable[0].where}")
    order = list(candidates) + sorted((set(trainers) | {me}) - set(candidates))
    failed = {p for p in order if current.get(p) is not None and current[p].error}
    if failed == set(order):
        return PauseTurn("give_up", f"every one of the {len(order)} peer(s) failed to write the snapshot")
    ahead = order[:order.index(me)]
    if all(p in failed for p in ahead):
        why = "this peer is the elected writer" if not ahead else f"{len(ahead)} writer(s) before it failed"
        return PauseTurn("write", why)
    writing = [p for p in ahead if p in current and p not in failed and not current[p].left]
    if writing:
        return PauseTurn("wait", f"writer {writing[0]} is writing the snapshot")
    if now - since >= len(ahead) * takeover_s:
        return PauseTurn("write", f"no snapshot after {now - since:.0f}s from the {len(ahead)} writer(s) before it")
    return PauseTurn("wait", f"writer {ahead[0]} writes the snapshot")


def trainer_notes(notes: Mapping[str, PauseNote], *, trainers: Iterable[str], step: int = 0) -> dict[str, PauseNote]:
    """The pause notes that count: signed by a trainer of the run (``notes`` by signer, read with ``signed=True``)
    and for a step at least ``step``. A stranger's note, even one naming a store of its own, is not a trainer's word
    that it left or where the snapshot is.

    Args:
        trainers: peer ids of the run's trainers as the reader knows them (its view, gate-checked where invite-only).
    """
    members = set(trainers)
    return {p: n for p, n in notes.items() if p in members and n.step >= step}


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimal checkpoint interval ``sqrt(2 * C * M)`` (seconds)."""
    return math.sqrt(2.0 * max(cost_s, 1e-3) * max(mtbf_s, 1e-3))


def estimate_mtbf(*, failures: int, observed_s: float, prior_s: float = 3600.0) -> float:
    """Mean time between failures of the swarm from what was observed, with one prior failure per ``prior_s``
    (so a young run without failures does not conclude that it never fails)."""
    return (max(observed_s, 0.0) + prior_s) / (max(failures, 0) + 1)


def parse_every(value: Optional[str]) -> tuple[Optional[int], Optional[float], bool]:
    """``--snapshot-every``: ``N`` steps, ``Nm``/``Ns`` minutes/seconds, or ``auto`` -> (steps, seconds, auto).

    Raises:
        UsageError: anything else.
    """
    if value is None or value == "auto":
        return None, None, True
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([ms]?)", value.strip())
    if not m or float(m.group(1)) <= 0 or (not m.group(2) and "." in m.group(1)):
        raise UsageError(f"--snapshot-every must be N (steps), Nm (minutes), Ns (seconds) or auto, not {value!r}")
    if not m.group(2):
        return int(m.group(1)), None, False
    return None, float(m.group(1)) * (60.0 if m.group(2) == "m" else 1.0), False


@dataclass(frozen=True, kw_only=True)
class SnapshotPolicy:
    """When to snapshot: every ``every_steps`` steps, every ``every_seconds``, or ``auto`` (Young/Daly)."""

    every_steps: Optional[int] = None
    every_seconds: Optional[float] = None
    auto: bool = False
    keep: int = 3
    prior_mtbf_s: float = 3600.0


@dataclass(frozen=True)
class SnapshotDecision:
    write: bool
    reason: str
    interval_s: Optional[float] = None  # the auto policy's interval
    replay_s: Optional[float] = None  # expected work replayed after a failure


def decide_snapshot(now: float, *, step: int, last_step: Optional[int], last_time: Optional[float],
                    policy: SnapshotPolicy, cost_s: Optional[float], failures: int, observed_s: float,
                    elected: bool) -> SnapshotDecision:
    """Whether to write the state of ``step`` now.

    Args:
        now: clock (seconds, monotonic). last_step/last_time: the previous snapshot (None: none yet).
        cost_s: measured cost of one snapshot (None: not measured yet). failures/observed_s: peers lost
            and the time watched, for the auto policy. elected: this peer is the writer.
    """
    if not elected:
        return SnapshotDecision(False, "another peer is the elected writer")
    if last_step is not None and step <= last_step:
        return SnapshotDecision(False, f"step {step} is already snapshotted")
    if last_step is None or last_time is None:
        return SnapshotDecision(True, "first snapshot of this peer (it also measures the cost)")
    if policy.every_steps is not None:
        due = step - last_step >= policy.every_steps
        return SnapshotDecision(due, f"every {policy.every_steps} steps")
    if policy.every_seconds is not None:
        due = now - last_time >= policy.every_seconds
        return SnapshotDecision(due, f"every {policy.every_seconds:g}s")
    mtbf = estimate_mtbf(failures=failures, observed_s=observed_s, prior_s=policy.prior_mtbf_s)
    interval = young_daly_interval(cost_s if cost_s is not None else 1.0, mtbf)
    replay = interval / 2 + (cost_s or 0.0)
    return SnapshotDecision(now - last_time >= interval,
                            f"auto: cost {cost_s or 0:.3f}s, MTBF {mtbf:.0f}s ({failures} failures in "
                            f"{observed_s:.0f}s) -> every {interval:.1f}s", interval, replay)


def amend_changes(sets: Mapping[str, str], hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``--set key=value`` of a move, typed like the spec's current values.

    Raises:
        UsageError: a key that may not change (task, data, block size, ...) or a bad value.
    """
    out: dict[str, Any] = {}
    for key, raw in sets.items():
        if key not in AMENDABLE:
            raise UsageError(f"--set {key} cannot change when a run moves (only {', '.join(AMENDABLE)}; "
                             f"the task and the data are fixed for the life of a run)")
        current = hparams.get(key)
        try:
            value: Any = int(raw) if _is_int(current) or key in BUDGET_HPARAMS else float(raw)
        except ValueError:
            raise UsageError(f"--set {key}={raw!r}: expected a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--set {key} must be positive")
        out[key] = value
    return out


@dataclass
class FailureWatch:
    """Counts trainers that vanished from the view without finishing: the failure rate of the auto policy."""

    started: float
    seen: dict = field(default_factory=dict)
    failures: int = 0

    def update(self, now: float, trainers: Mapping[str, Any], me: str) -> None:
        current = {p for p in trainers if p != me}
        for peer in set(self.seen) - current:
            if not getattr(self.seen[peer], "finished", False):
                self.failures += 1
        self.seen = {p: trainers[p] for p in current}

    def observed_s(self, now: float) -> float:
        return max(0.0, now - self.started)
