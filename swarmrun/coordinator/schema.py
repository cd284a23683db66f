"""The JSON bodies the coordinator accepts, parsed into frozen dataclasses by pure functions.

Why a module of its own: the HTTP API and the registry both need the same checks (a run id's
alphabet, ``1 <= min_peers <= max_peers``, a priority name), and a request must be refused
before it touches the database. Each ``parse_*`` takes the decoded JSON (any type: it comes
from the network) and returns a dataclass or raises ``UsageError`` with the field's name, so
the API can answer 422 with a message a user can act on. No I/O here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from swarmrun.protocol.errors import UsageError
from swarmrun.protocol.spec import RUN_ID

__all__ = [
    "PRIORITY_NAMES",
    "CURSOR_KEYS",
    "RUN_ID_RE",
    "Submission",
    "Resources",
    "Registration",
    "Heartbeat",
    "Progress",
    "check_name",
    "parse_priority",
    "parse_submission",
    "parse_resources",
    "parse_registration",
    "parse_heartbeat",
    "parse_progress",
    "parse_patch",
    "parse_certificate_request",
    "parse_spec_request",
]

RUN_ID_RE = RUN_ID
"""Run ids, user names and worker ids: safe in a URL path, a file name and a DHT key (the one run-id pattern)."""
_TASK_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_DEVICE_RE = re.compile(r"^[a-z0-9_]{1,32}$")
PRIORITY_NAMES = {"low": 0, "normal": 1, "high": 2}
_PRIORITY_BOUND = 1_000_000  # any lab's ladder of priorities fits; the bound keeps them in a 32-bit column
_PEERS_BOUND = 100_000
_SHARE_BOUND = 1e6
CURSOR_KEYS = ("samples_applied", "blocks_applied", "blocks_pending", "blocks_skipped", "blocks_duplicated", "data_epoch")
"""The data cursor's summary (``DataCursor.summary()``) a progress report may carry: the run's data accounting."""


@dataclass(frozen=True, kw_only=True)
class Submission:
    """A run as a user submits it: what to run, how important, on how many and what machines."""

    run_id: str
    task: str
    task_args: dict[str, Any]
    priority: int = 1
    min_peers: int = 1
    max_peers: int = 1
    share: float = 1.0
    need_device: str | None = None
    need_memory_gib: float | None = None
    total_steps: int | None = None


@dataclass(frozen=True, kw_only=True)
class Resources:
    """A workstation's resources: its devices (kind, memory), CPU count and RAM."""

    devices: tuple[tuple[str, float], ...] = ()
    cpus: int = 1
    ram_gib: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The form stored in the registry and served to the dashboard."""
        return {
            "devices": [{"kind": k, "memory_gib": m} for k, m in self.devices],
            "cpus": self.cpus,
            "ram_gib": self.ram_gib,
        }


@dataclass(frozen=True, kw_only=True)
class Registration:
    """An agent's first message: which workstation it is and what it has."""

    worker_id: str
    hostname: str
    resources: Resources


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """An agent's periodic message: is the resident here; resources if they changed."""

    resident_present: bool
    resources: Resources | None = None
    peer_run_id: str | None = None  # the run of the peer this agent runs now, if any
    peer_maddr: str | None = None  # where that peer listens (others of the run join through it)


@dataclass(frozen=True, kw_only=True)
class Progress:
    """What a run's peers or agents report: where the run is and how fast it goes."""

    step: int
    loss: float | None = None
    samples_per_second: float | None = None
    peers: int | None = None
    samples: int | None = None
    snapshot_url: str | None = None
    snapshot_step: int | None = None
    eval_step: int | None = None  # the step whose model the held-out evaluation measured
    eval_loss: float | None = None
    cursor: dict[str, int] | None = None  # the data cursor's summary at ``step`` (CURSOR_KEYS)


def _object(body: Any, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
    """``body`` as a JSON object with only ``allowed`` keys and every ``required`` one.

    Unknown keys are refused rather than ignored, so a misspelt field (``min_peer``) is an
    error the user sees, not a silent default.
    """
    if not isinstance(body, dict):
        raise UsageError("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise UsageError(f"unknown field(s): {', '.join(unknown)}")
    missing = sorted(required - set(body))
    if missing:
        raise UsageError(f"missing field(s): {', '.join(missing)}")
    return body


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    # bool is an int in Python; JSON true is not a count.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"{name} must be an integer in [{lo}, {hi}]")
    return value


def _number(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{name} must be a number")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise UsageError(f"{name} must be a finite number in [{lo}, {hi}]")
    return value


def _optional(body: dict, key: str, parse, *args):
    value = body.get(key)
    return None if value is None else parse(value, key, *args)


def _string(value: Any, name: str, pattern: re.Pattern) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise UsageError(f"{name} must match {pattern.pattern}")
    return value


def check_name(value: Any, what: str = "run_id") -> str:
    """``value`` if it is a valid run id, user name or worker id; else ``UsageError``."""
    return _string(value, what, RUN_ID_RE)


def parse_priority(value: Any) -> int:
    """An integer priority (higher first), or one of the names low/normal/high (0/1/2)."""
    if isinstance(value, str):
        if value.lower() in PRIORITY_NAMES:
            return PRIORITY_NAMES[value.lower()]
        raise UsageError(f"priority must be an integer or one of {', '.join(PRIORITY_NAMES)}")
    return _int(value, "priority", -_PRIORITY_BOUND, _PRIORITY_BOUND)


def parse_submission(body: Any) -> Submission:
    """A validated ``Submission`` from a ``POST /api/runs`` body."""
    fields = {"run_id", "task", "task_args", "priority", "min_peers", "max_peers", "share", "needs", "total_steps"}
    body = _object(body, fields, {"run_id", "task"})
    task_args = body.get("task_args", {})
    if not isinstance(task_args, dict):
        raise UsageError("task_args must be a JSON object")
    min_peers = _int(body.get("min_peers", 1), "min_peers", 1, _PEERS_BOUND)
    max_peers = _int(body.get("max_peers", min_peers), "max_peers", 1, _PEERS_BOUND)
    if max_peers < min_peers:
        raise UsageError("min_peers must not exceed max_peers")
    needs = _object(body.get("needs") or {}, {"device", "memory_gib"})
    return Submission(
        run_id=check_name(body["run_id"]),
        task=_string(body["task"], "task", _TASK_RE),
        task_args=task_args,
        priority=parse_priority(body.get("priority", 1)),
        min_peers=min_peers,
        max_peers=max_peers,
        share=_number(body.get("share", 1.0), "share", 1e-6, _SHARE_BOUND),
        need_device=_optional(needs, "device", _string, _DEVICE_RE),
        need_memory_gib=_optional(needs, "memory_gib", _number, 0.0, 1e6),
        total_steps=_optional(body, "total_steps", _int, 1, 2**62),
    )


def parse_resources(body: Any) -> Resources:
    """Validated ``Resources`` from ``{"devices": [{"kind", "memory_gib"}], "cpus", "ram_gib"}``."""
    body = _object(body, {"devices", "cpus", "ram_gib"})
    devices = body.get("devices", [])
    if not isinstance(devices, list) or len(devices) > 64:
        raise UsageError("devices must be a list of at most 64 devices")
    parsed = []
    for device in devices:
        device = _object(device, {"kind", "memory_gib"}, {"kind"})
        parsed.append(
            (
                _string(device["kind"], "devices[].kind", _DEVICE_RE),
                _number(device.get("memory_gib", 0.0), "devices[].memory_gib", 0.0, 1e6),
            )
        )
    return Resources(
        devices=tuple(parsed),
        cpus=_int(body.get("cpus", 1), "cpus", 1, 1_000_000),
        ram_gib=_number(body.get("ram_gib", 0.0), "ram_gib", 0.0, 1e9),
    )


def parse_registration(body: Any) -> Registration:
    """A validated ``Registration`` from a ``POST /api/workers/register`` body."""
    body = _object(body, {"worker_id", "hostname", "resources"}, {"worker_id", "hostname"})
    hostname = body["hostname"]
    if not isinstance(hostname, str) or not 1 <= len(hostname) <= 255 or not hostname.isprintable():
        raise UsageError("hostname must be a printable string of 1 to 255 characters")
    return Registration(
        worker_id=check_name(body["worker_id"], "worker_id"),
        hostname=hostname,
        resources=parse_resources(body.get("resources", {})),
    )


def parse_heartbeat(body: Any) -> Heartbeat:
    """A validated ``Heartbeat`` from a ``POST /api/workers/{id}/heartbeat`` body."""
    body = _object(body, {"resident_present", "resources", "peer"}, {"resident_present"})
    if not isinstance(body["resident_present"], bool):
        raise UsageError("resident_present must be true or false")
    resources = body.get("resources")
    # a peer without maddr is starting (not listening yet): its worker is not the one to create or resume the run
    peer = _object(body.get("peer") or {}, {"run_id", "maddr"}, {"run_id"} if body.get("peer") else set())
    maddr = peer.get("maddr")
    if maddr is not None and (not isinstance(maddr, str) or not 1 <= len(maddr) <= 512 or not maddr.isprintable()):
        raise UsageError("peer.maddr must be a printable string of 1 to 512 characters")
    return Heartbeat(
        resident_present=body["resident_present"],
        resources=None if resources is None else parse_resources(resources),
        peer_run_id=None if not peer else check_name(peer["run_id"], "peer.run_id"),
        peer_maddr=maddr,
    )


def parse_progress(body: Any) -> Progress:
    """A validated ``Progress`` from a ``POST /api/runs/{id}/progress`` body."""
    fields = {"step", "loss", "samples_per_second", "peers", "samples", "snapshot", "eval", "cursor"}
    body = _object(body, fields, {"step"})
    evaluation = _object(body.get("eval") or {}, {"step", "loss"}, {"step", "loss"} if body.get("eval") else set())
    cursor = None
    if body.get("cursor") is not None:
        cursor = {k: _int(v, f"cursor.{k}", 0, 2**62) for k, v in _object(body["cursor"], set(CURSOR_KEYS)).items()}
    snapshot = _object(body.get("snapshot") or {}, {"url", "step"}, {"url", "step"} if body.get("snapshot") else set())
    url = snapshot.get("url")
    # Printable only: PostgreSQL's text refuses NUL, and a URL has no control characters.
    if url is not None and (not isinstance(url, str) or not 1 <= len(url) <= 4096 or not url.isprintable()):
        raise UsageError("snapshot.url must be a printable string of 1 to 4096 characters")
    return Progress(
        step=_int(body["step"], "step", 0, 2**62),
        loss=_optional(body, "loss", _number, -math.inf, math.inf),
        samples_per_second=_optional(body, "samples_per_second", _number, 0.0, 1e15),
        peers=_optional(body, "peers", _int, 0, _PEERS_BOUND),
        samples=_optional(body, "samples", _int, 0, 2**62),
        snapshot_url=url,
        snapshot_step=_optional(snapshot, "step", _int, 0, 2**62),
        eval_step=_optional(evaluation, "step", _int, 0, 2**62),
        eval_loss=_optional(evaluation, "loss", _number, -math.inf, math.inf),
        cursor=cursor or None,
    )


def parse_patch(body: Any) -> int:
    """The new priority from a ``PATCH /api/runs/{id}`` body (the only field a user may change)."""
    body = _object(body, {"priority"}, {"priority"})
    return parse_priority(body["priority"])


def parse_certificate_request(body: Any) -> tuple[str, str]:
    """(worker_id, peer_id) from a ``POST /api/runs/{id}/certificate`` body: the peer an assigned worker starts."""
    from swarmrun.coordinator.owner import check_peer_id

    body = _object(body, {"worker_id", "peer_id"}, {"worker_id", "peer_id"})
    return check_name(body["worker_id"], "worker_id"), check_peer_id(body["peer_id"])


def parse_spec_request(body: Any) -> tuple[str, bytes]:
    """(worker_id, unsigned spec bytes) from a ``POST /api/runs/{id}/spec`` body (``spec``: base64)."""
    import base64
    import binascii

    body = _object(body, {"worker_id", "spec"}, {"worker_id", "spec"})
    if not isinstance(body["spec"], str) or not body["spec"]:
        raise UsageError("spec must be the unsigned spec's bytes in base64")
    try:
        spec = base64.b64decode(body["spec"], validate=True)
    except (binascii.Error, ValueError):
        raise UsageError("spec must be the unsigned spec's bytes in base64") from None
    return check_name(body["worker_id"], "worker_id"), spec
