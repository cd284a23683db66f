"""The spec: the immutable, owner-signed description of a run.

Crypto is injected as callables (``signer(data) -> signature`` and
``verifier(public_key, data, signature) -> bool``) so this module stays free of
hivemind. The signature covers ``Spec.unsigned_bytes()``; ``spec_hash`` is the
sha256 of the same bytes and is part of every state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.errors import (IncompatibleState, LocalProtocolError, RemoteProtocolError, SwarmrunError,
                                      UsageError)
from swarmrun.protocol.outer import OUTER_DEFAULTS, OUTERS, check_outer, outer_hparams

__all__ = ["SPEC_VERSION", "ACCESS_POLICIES", "COMPRESSIONS", "OUTERS", "OUTER_DEFAULTS", "OPTIONAL_HPARAMS", "RUN_ID", "BUDGET_HPARAMS", "check_run_id", "Spec",
           "SignedSpec", "amend", "outer_hparams", "choose_spec", "choose_budget", "planned_steps", "budget_reached", "steps_left"]

SPEC_VERSION = 1
DEFAULT_STEP_TOLERANCE = 0.05
ACCESS_POLICIES = ("open", "invite")
#: the codecs of a run's gradient all-reduce (hparam ``compression``; ``node.peer.codecs`` builds them): each part is
#: encoded once by its sender and once by its reducer, and every participant uses the decoded bits
COMPRESSIONS = ("none", "fp16", "bf16", "8bit", "quantile8bit")
#: hyperparameters a spec holds only when a run sets them (a run without them has the spec it had before them), with
#: the default a peer assumes when one is absent
OPTIONAL_HPARAMS = {"error_feedback": False, "outer_overlap": False}
_UNAVAILABLE_COMPRESSIONS = {"blockwise8": "hivemind's blockwise 8-bit codec needs bitsandbytes, which swarmrun does "
                                           "not depend on; use 8bit"}
MAX_SPEC_SIZE = 1 << 20

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the one run-id pattern (the CLI, the coordinator, specs)
_REQUIRED_POSITIVE_HPARAMS = ("target_batch_size", "block_size")
# a run's length: exactly one of them is in its hparams (a spec without total_samples or epochs encodes, and hashes,
# as it did before they existed). epochs are whole passes over the dataset: epochs * num_examples samples.
BUDGET_HPARAMS = ("total_steps", "total_samples", "epochs")
# block_size fixes the unit of data accounting: changing it would orphan the cursor; outer fixes what the state's
# optimizer is (the task's, or the outer one).
_FIXED_HPARAMS = ("block_size", "outer")
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1

Scalar = str | int | float | bool
_SPEC_KEYS = frozenset({
    "type", "version", "run_id", "task", "task_version", "task_args", "hparams", "seed",
    "data_fingerprint", "num_examples", "owner_key", "access", "created_at",
})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_scalars(name: str, mapping: Any) -> dict[str, Scalar]:
    if not isinstance(mapping, Mapping):
        raise UsageError(f"spec field {name} must be a mapping, got {type(mapping).__name__}")
    out: dict[str, Scalar] = {}
    for key in sorted(mapping, key=lambda k: (not isinstance(k, str), str(k))):
        value = mapping[key]
        if not isinstance(key, str) or not key:
            raise UsageError(f"spec field {name} has a key {key!r} that is not a non-empty str")
        if not isinstance(value, (str, int, float, bool)):
            raise UsageError(f"spec field {name}[{key!r}] must be str, int, float or bool, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"spec field {name}[{key!r}] is not finite")
        if _is_int(value) and not _INT64_MIN <= value <= _UINT64_MAX:
            raise UsageError(f"spec field {name}[{key!r}] is out of the 64-bit range")
        out[key] = value
    return out


def _check_compression(value: Any) -> None:
    if value in _UNAVAILABLE_COMPRESSIONS:
        raise UsageError(f"hparams['compression'] {value!r} is not available: {_UNAVAILABLE_COMPRESSIONS[value]}")
    if value not in COMPRESSIONS:
        raise UsageError(f"hparams['compression'] must be one of {', '.join(COMPRESSIONS)}, got {value!r}")


def check_run_id(run_id: str) -> str:
    """``run_id`` itself, when it is 1-64 letters, digits, '-' and '_'.

    Raises:
        UsageError: anything else.
    """
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise UsageError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '-' and '_'")
    return run_id


@dataclass(frozen=True, kw_only=True)
class Spec:
    """The immutable description of a run (see the glossary in ``swarmrun.protocol``).

    ``hparams`` must hold positive ints ``target_batch_size`` and ``block_size``, and one budget:
    ``total_steps``, ``total_samples`` or ``epochs`` (see ``budget_reached``). Construction validates every field.

    Raises:
        UsageError: a field is missing, of the wrong type or out of range.
    """

    run_id: str
    task: str
    task_version: str
    task_args: Mapping[str, Scalar]
    hparams: Mapping[str, Scalar]
    seed: int
    data_fingerprint: str
    num_examples: int
    owner_key: bytes
    access: str = "open"
    created_at: float = 0.0
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not RUN_ID.fullmatch(self.run_id):
            raise UsageError(f"run_id {self.run_id!r} must match [A-Za-z0-9_-]{{1,64}}")
        for name in ("task", "task_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise UsageError(f"spec field {name} must be a non-empty str")
        if not isinstance(self.data_fingerprint, str):
            raise UsageError("spec field data_fingerprint must be a str")
        object.__setattr__(self, "task_args", _check_scalars("task_args", self.task_args))
        object.__setattr__(self, "hparams", _check_scalars("hparams", self.hparams))
        for name in _REQUIRED_POSITIVE_HPARAMS:
            value = self.hparams.get(name)
            if not _is_int(value) or value <= 0:
                raise UsageError(f"hparams[{name!r}] must be a positive int, got {value!r}")
        budgets = [name for name in BUDGET_HPARAMS if name in self.hparams]
        if len(budgets) != 1:
            raise UsageError(f"hparams must hold exactly one of {', '.join(BUDGET_HPARAMS)} (the run's length), "
                             f"got {', '.join(budgets) or 'none'}")
        if not _is_int(self.hparams[budgets[0]]) or self.hparams[budgets[0]] <= 0:
            raise UsageError(f"hparams[{budgets[0]!r}] must be a positive int, got {self.hparams[budgets[0]]!r}")
        _check_compression(self.hparams.get("compression", "none"))
        feedback = self.hparams.get("error_feedback", False)
        if not isinstance(feedback, bool):
            raise UsageError(f"hparams['error_feedback'] must be true or false, got {feedback!r}")
        if feedback and self.hparams.get("compression", "none") == "none":
            raise UsageError("hparams['error_feedback'] needs a lossy compression (fp16, bf16, 8bit, quantile8bit): "
                             "with none nothing is lost to carry forward")
        check_outer(self.hparams)
        overlap = self.hparams.get("outer_overlap", False)
        if not isinstance(overlap, bool):
            raise UsageError(f"hparams['outer_overlap'] must be true or false, got {overlap!r}")
        if overlap and self.hparams.get("outer", "none") != "diloco":
            raise UsageError("hparams['outer_overlap'] needs outer=diloco: it runs the next inner steps while the "
                             "outer round communicates")
        tolerance = self.hparams.get("step_tolerance", DEFAULT_STEP_TOLERANCE)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
            raise UsageError(f"hparams['step_tolerance'] must be a number in [0, 1), got {tolerance!r}")
        if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _UINT64_MAX:
            raise UsageError(f"seed must be an int in the 64-bit range, got {self.seed!r}")
        if not _is_int(self.num_examples) or not 0 < self.num_examples <= _UINT64_MAX:
            raise UsageError(f"num_examples must be a positive int, got {self.num_examples!r}")
        if isinstance(self.owner_key, (bytearray, memoryview)):
            object.__setattr__(self, "owner_key", bytes(self.owner_key))
        if not isinstance(self.owner_key, bytes):
            raise UsageError("owner_key must be bytes")
        if self.access not in ACCESS_POLICIES:
            raise UsageError(f"access must be one of {ACCESS_POLICIES}, got {self.access!r}")
        if _is_int(self.created_at):
            object.__setattr__(self, "created_at", float(self.created_at))
        if not isinstance(self.created_at, float) or not math.isfinite(self.created_at):
            raise UsageError("created_at must be a finite float")
        if self.version != SPEC_VERSION:
            raise UsageError(f"spec version {self.version!r} is not supported (this build reads {SPEC_VERSION})")

    def __hash__(self) -> int:
        # the generated hash would fail on the dict fields
        return hash(self.unsigned_bytes())

    @property
    def target_batch_size(self) -> int:
        """Samples the swarm processes together per step."""
        return int(self.hparams["target_batch_size"])

    @property
    def total_steps(self) -> int:
        """Steps after which the run is complete; under a sample budget, the planned number of steps
        (``planned_steps``: the default schedule's horizon, the progress shown and the ETA), while the run
        itself ends on samples (``finished``)."""
        total = self.total_samples
        if total is None:
            return int(self.hparams["total_steps"])
        return planned_steps(total, num_examples=self.num_examples, target_batch_size=self.target_batch_size)

    @property
    def total_samples(self) -> int | None:
        """The sample budget: ``total_samples``, or ``epochs`` x ``num_examples``; None when ``total_steps``
        bounds the run."""
        if "total_samples" in self.hparams:
            return int(self.hparams["total_samples"])
        if "epochs" in self.hparams:
            return int(self.hparams["epochs"]) * self.num_examples
        return None

    def finished(self, step: int, cursor: Any) -> bool:
        """Whether the run is complete at ``step`` with this data cursor (``budget_reached``)."""
        return budget_reached(self, step=step, samples=cursor.samples_applied())

    def steps_left(self, step: int, cursor: Any) -> int:
        """Steps the run still needs (an estimate under a sample budget: see ``steps_left``)."""
        return steps_left(self, step=step, samples=cursor.samples_applied())

    @property
    def block_size(self) -> int:
        """Examples per block of the data order."""
        return int(self.hparams["block_size"])

    @property
    def step_tolerance(self) -> float:
        """A committed step carries ``target_batch_size`` within this fraction (0.05 for a spec without one)."""
        return float(self.hparams.get("step_tolerance", DEFAULT_STEP_TOLERANCE))

    @property
    def compression(self) -> str:
        """The codec of the gradient all-reduce, one of ``COMPRESSIONS`` (``none`` for a spec without one)."""
        return str(self.hparams.get("compression", "none"))

    @property
    def error_feedback(self) -> bool:
        """Whether each peer carries what the codec lost into its next contribution (``node.peer.feedback``)."""
        return bool(self.hparams.get("error_feedback", False))

    @property
    def outer(self) -> str:
        """How a committed step is made, one of ``OUTERS`` (``none`` for a spec without one)."""
        return str(self.hparams.get("outer", "none"))

    @property
    def outer_overlap(self) -> bool:
        """Outer mode only: whether a trainer takes the next step's inner steps while the outer round communicates
        (``node.peer.work.InnerSteps.carry``: applied on top of the committed state, one round late)."""
        return bool(self.hparams.get("outer_overlap", False))

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps each trainer takes per outer step (outer mode; 1 otherwise)."""
        return int(self.hparams.get("inner_steps", 1))

    def to_dict(self) -> dict[str, Any]:
        """Return the plain, msgpack-able form (keys sorted on encode)."""
        return {
            "type": "spec",
            "version": self.version,
            "run_id": self.run_id,
            "task": self.task,
            "task_version": self.task_version,
            "task_args": dict(self.task_args),
            "hparams": dict(self.hparams),
            "seed": self.seed,
            "data_fingerprint": self.data_fingerprint,
            "num_examples": self.num_examples,
            "owner_key": self.owner_key,
            "access": self.access,
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Spec:
        """Build a spec from its plain form, validating everything.

        Raises:
            RemoteProtocolError: ``d`` is not a valid spec of this version.
        """
        if not isinstance(d, Mapping):
            raise RemoteProtocolError(f"spec must be a map, got {type(d).__name__}")
        if set(d) != _SPEC_KEYS:
            raise RemoteProtocolError(f"spec keys differ from the expected ones: {sorted(map(str, set(d) ^ _SPEC_KEYS))}")
        if d["type"] != "spec":
            raise RemoteProtocolError(f"expected a spec, got type {d['type']!r}")
        kwargs = {key: value for key, value in d.items() if key != "type"}
        try:
            return cls(**kwargs)
        except UsageError as exc:
            raise RemoteProtocolError(f"invalid spec: {exc}") from None

    def unsigned_bytes(self) -> bytes:
        """Return the deterministic encoding the owner signs."""
        return pack(self.to_dict())

    def spec_hash(self) -> str:
        """Return the sha256 hex digest of ``unsigned_bytes()``."""
        return hashlib.sha256(self.unsigned_bytes()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class SignedSpec:
    """A spec with the owner's signature over ``spec.unsigned_bytes()``.

    ``certificates`` is reserved for access certificates: carried, not checked here.
    """

    spec: Spec
    signature: bytes
    certificates: tuple = field(default=())

    @classmethod
    def sign(cls, spec: Spec, signer: Callable[[bytes], bytes]) -> SignedSpec:
        """Sign ``spec`` with ``signer(data) -> signature`` (the owner's private key)."""
        return cls(spec=spec, signature=bytes(signer(spec.unsigned_bytes())))

    def verify(self, verifier: Callable[[bytes, bytes, bytes], bool]) -> None:
        """Check the signature with ``verifier(public_key, data, signature) -> bool``.

        Raises:
            IncompatibleState: the signature does not verify against ``spec.owner_key``.
        """
        try:
            ok = verifier(self.spec.owner_key, self.spec.unsigned_bytes(), self.signature)
        except Exception as exc:  # a crypto library's error on a malformed key or signature
            raise IncompatibleState(
                f"spec signature does not verify for run {self.spec.run_id!r}: {type(exc).__name__}: {exc}"
            ) from None
        if ok is not True:
            raise IncompatibleState(
                f"spec signature does not verify for run {self.spec.run_id!r} against the owner's key"
            )

    def encode(self) -> bytes:
        """Return the msgpack encoding of the signed spec.

        Raises:
            LocalProtocolError: a certificate cannot be encoded.
        """
        if not isinstance(self.signature, bytes):
            raise LocalProtocolError("signature must be bytes")
        return pack({
            "type": "signed_spec",
            "version": SPEC_VERSION,
            "spec": self.spec.to_dict(),
            "signature": self.signature,
            "certificates": list(self.certificates),
        })

    @classmethod
    def decode(cls, data: bytes, *, max_size: int = MAX_SPEC_SIZE) -> SignedSpec:
        """Decode and validate a signed spec (the signature is not checked: see ``verify``).

        Raises:
            RemoteProtocolError: the bytes are not a valid signed spec.
        """
        d = unpack(data, max_size=max_size)
        if not isinstance(d, dict) or set(d) != {"type", "version", "spec", "signature", "certificates"}:
            raise RemoteProtocolError("signed spec must be a map with keys type, version, spec, signature, certificates")
        if d["type"] != "signed_spec" or d["version"] != SPEC_VERSION:
            raise RemoteProtocolError(f"unsupported message {d['type']!r} version {d['version']!r}")
        if not isinstance(d["signature"], bytes):
            raise RemoteProtocolError("signature must be bytes")
        if not isinstance(d["certificates"], list):
            raise RemoteProtocolError("certificates must be a list")
        return cls(spec=Spec.from_dict(d["spec"]), signature=d["signature"], certificates=tuple(d["certificates"]))


def amend(spec: Spec, **changes: Any) -> Spec:
    """Return ``spec`` with hyperparameters changed; nothing else may change.

    Each keyword is an hparam name (``amend(spec, lr=0.1, total_steps=2000)``),
    or ``hparams=`` replaces the whole mapping (individual keywords then apply on
    top). A budget keyword (``total_steps``, ``total_samples``, ``epochs``) replaces
    the run's budget, whichever it was. ``block_size`` is fixed for the life of a run.

    Raises:
        UsageError: a keyword names another spec field, ``block_size`` would
            change, or the result is not a valid spec.
    """
    fields = {f.name for f in dataclasses.fields(Spec)} - {"hparams"}
    forbidden = sorted(set(changes) & fields)
    if forbidden:
        raise UsageError(f"amend changes hyperparameters only; cannot change {', '.join(forbidden)}")
    hparams = dict(changes.pop("hparams", spec.hparams))
    if any(name in changes for name in BUDGET_HPARAMS):
        hparams = {k: v for k, v in hparams.items() if k not in BUDGET_HPARAMS}
    hparams.update(changes)
    for name in _FIXED_HPARAMS:
        if hparams.get(name) != spec.hparams.get(name):
            raise UsageError(f"{name} is fixed for the life of a run (the run's state is laid out by it)")
    return dataclasses.replace(spec, hparams=hparams)


def choose_spec(found: Mapping[str, bytes], *, run_id: str, anchors: Collection[str],
                verifier: Callable[[bytes, bytes, bytes], bool]) -> tuple[SignedSpec | None, tuple[str, ...]]:
    """The run's spec among those published under peers' signed subkeys (``found``: encoded spec by signer).

    A spec that does not decode, verify or name ``run_id`` is skipped, with its reason, never fatal while another
    verifies. The peers this one was given (``anchors``, the peer ids of ``--peers``) are the trust root: when any of
    them publishes a spec that verifies, the one most of them publish is taken, and a stranger's own validly signed
    spec for the same run id (its own key as owner) neither replaces nor hides it. When none of them does (a
    bootstrap-only node), a spec is taken only if every verifying one is the same.

    Returns:
        (the spec or None, the reasons of the skipped ones).
    Raises:
        IncompatibleState: the anchors are split evenly between specs, or, without an anchor's spec, verifying
            specs differ (someone else publishes a spec for this run id: give --peers of the run's peers).
    """
    good: dict[str, SignedSpec] = {}
    skipped = []
    for signer, data in sorted(found.items()):
        try:
            signed = SignedSpec.decode(data)
            signed.verify(verifier)
            if signed.spec.run_id != run_id:
                raise IncompatibleState(f"it names run {signed.spec.run_id!r}")
        except (SwarmrunError, TypeError, ValueError) as e:
            skipped.append(f"the spec from {signer[-6:]} was skipped: {e}")
            continue
        good[signer] = signed
    anchored = {s: good[s] for s in anchors if s in good}
    pool = anchored or good
    if not pool:
        return None, tuple(skipped)
    votes: dict[bytes, list[str]] = {}
    for signer, signed in pool.items():
        votes.setdefault(signed.encode(), []).append(signer)
    ranked = sorted(votes.values(), key=len, reverse=True)
    if len(ranked) > 1 and (not anchored or len(ranked[0]) == len(ranked[1])):
        who = "the given peers" if anchored else "peers other than the given ones"
        raise IncompatibleState(f"{who} publish {len(ranked)} different specs for run {run_id!r}; give --peers of "
                                f"the run's own peers")
    return pool[ranked[0][0]], tuple(skipped)


# ---- the run's length --------------------------------------------------------------------------------------
def choose_budget(defaults: Mapping[str, Any], given: Collection[str]) -> dict[str, Any]:
    """``defaults`` (a task's hyperparameters) with one budget: the one named in ``given`` (the keys a user set),
    else a sample budget the defaults hold (``total_samples`` or ``epochs``: a task's own, over the base
    ``total_steps``), else ``total_steps``. A budget named in ``given`` needs no default (its value is set later).

    Raises:
        UsageError: ``given`` names two budgets, or the defaults hold two sample budgets and ``given`` none.
    """
    named = [name for name in BUDGET_HPARAMS if name in given]
    if len(named) > 1:
        raise UsageError(f"give one run length, not {' and '.join(named)}")
    if not named:
        named = [name for name in BUDGET_HPARAMS[1:] if name in defaults] or ["total_steps"]
        if len(named) > 1:
            raise UsageError(f"the task's hyperparameters hold two run lengths ({' and '.join(named)}): set one")
    out = {k: v for k, v in defaults.items() if k not in BUDGET_HPARAMS}
    out[named[0]] = defaults.get(named[0], 0)
    return out


def planned_steps(total_samples: int, *, num_examples: int, target_batch_size: int) -> int:
    """Steps that ``total_samples`` take when every step holds ``target_batch_size`` samples and a data epoch's
    last step holds what is left of it (``round.step_target``): exact for whole epochs, give or take a step
    otherwise. At least 1."""
    full, rest = divmod(max(0, total_samples), num_examples)
    per_epoch = -(-num_examples // target_batch_size)
    return max(1, full * per_epoch + -(-rest // target_batch_size))


def budget_reached(spec: Spec, *, step: int, samples: int) -> bool:
    """Whether a run is complete at ``step`` with ``samples`` applied (``DataCursor.samples_applied()``, which
    every peer holds alike: it is part of the replicated state).

    Under ``total_steps``: ``step >= total_steps``. Under a sample budget: ``samples >= total_samples``, so the
    step that reaches the budget is the last one, and it is not trimmed: it carries its whole batch, and the run
    may apply up to one step's samples more than ``total_samples``. ``epochs`` end exactly on the budget, since
    a data epoch's last step holds only what is left of the epoch.
    """
    total = spec.total_samples
    return step >= spec.total_steps if total is None else samples >= total


def steps_left(spec: Spec, *, step: int, samples: int) -> int:
    """Steps until ``budget_reached``: exact under ``total_steps``; under a sample budget, the planned steps of
    the samples left (``planned_steps`` from the current position in the data epoch), at least 1 until the
    budget is reached."""
    total = spec.total_samples
    if total is None:
        return max(0, spec.total_steps - step)
    if samples >= total:
        return 0
    n, target, left = spec.num_examples, spec.target_batch_size, total - samples
    head = min(left, n - samples % n)  # what the budget takes of the current data epoch
    steps = -(-head // target)
    if left > head:
        steps += planned_steps(left - head, num_examples=n, target_batch_size=target)
    return steps
