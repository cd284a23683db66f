"""Pool traces: a lab's pool as data: a coordinator, agents on simulated workstations, runs submitted over time,
residents coming and going, the coordinator SIGKILLed and restarted.

A pool trace is a JSON object with ``"kind": "pool"`` (the other traces drive one run's peers directly; see
:mod:`simulations.trace`). Its runs are submitted to a real ``node coordinator`` and placed by it on real
``node agent`` processes, one per simulated workstation (``w1`` ... ``wN``); the harness never starts a peer
itself. Fields:

| field | meaning |
|---|---|
| ``workers`` | how many agents (workstations) |
| ``task``, ``runs`` | the task of every run, and each run's ``priority``, ``min_peers``, ``max_peers``, ``sets`` |
| ``events`` | what happens when (below) |
| ``duration`` | the runner stops after this many seconds of trace time whatever happens |
| ``min_residence`` | the coordinator's ``--min-residence`` (seconds an assignment is kept from preemption) |
| ``stop_timeout`` | the agents' ``--stop-timeout`` (SIGKILL of a stopping peer after this) |
| ``handback_bound`` | a returning resident has their machine back within this (the issue's 30 s) |
| ``utilisation_target`` | the lowest pool utilisation the trace accepts (the issue's 0.9) |
| ``loss_tolerance`` | each run's final eval loss against its replayed baseline (relative) |
| ``peer_args`` | arguments the agents pass to every peer's ``node join`` (e.g. ``["--min-peers", "2"]``: a peer alone
  does not step; the synthetic task alone takes a step in milliseconds, too fast to preempt anything) |

Events fire at ``time`` (seconds after every agent registered: trace time 0) or ``after`` a run's newest
committed step reaches a value (``{"run": "big", "step": 20}``; robust on a loaded machine). Kinds:

| kind | fields | what the runner does |
|---|---|---|
| ``submit`` | ``run`` | submits the run (``POST /api/runs``, as ``node submit`` does) |
| ``resident`` | ``worker``, ``duration`` (optional) | the resident returns to the workstation (its agent's ``file``
  source: what ``node agent busy`` sets); with ``duration``, leaves again that much later |
| ``coordinator_kill`` | ``down`` | SIGKILL to the coordinator's group; restarted on the same database ``down`` s later |

Why the ``file`` source and not the agent's ``script:FILE``: a script holds times since the agent started, and an
event here may wait for a run's step, which no time written in advance can say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from .trace import NAME_RE, TraceError, _int, _num

POOL_KINDS = ("submit", "resident", "coordinator_kill")


@dataclass(frozen=True, kw_only=True)
class PoolRunSpec:
    """One run of the trace, as ``node submit`` takes it."""

    run_id: str
    priority: int = 1
    min_peers: int = 1
    max_peers: int = 1
    sets: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PoolEvent:
    """One scripted happening. Exactly one of ``time`` and ``after`` (``(run_id, step)``) is set."""

    kind: str
    time: Optional[float] = None
    after: Optional[tuple[str, int]] = None
    run: Optional[str] = None  # submit
    worker: Optional[str] = None  # resident
    duration: Optional[float] = None  # resident: seconds present
    down: Optional[float] = None  # coordinator_kill: seconds before the restart
    source: str = "events"

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if v is not None and k != "after"}
        if self.after is not None:
            out["after"] = {"run": self.after[0], "step": self.after[1]}
        return out


@dataclass(frozen=True, kw_only=True)
class PoolTrace:
    """A parsed, validated pool trace (see the module docstring)."""

    name: str
    task: str = "synthetic"
    workers: int = 4
    runs: Mapping[str, PoolRunSpec] = field(default_factory=dict)
    events: tuple[PoolEvent, ...] = ()
    duration: float = 300.0
    min_residence: float = 10.0
    stop_timeout: float = 20.0
    handback_bound: float = 30.0
    matchmaking_time: float = 1.0
    utilisation_target: float = 0.9
    loss_tolerance: float = 0.02
    loss_abs_tolerance: float = 0.0
    peer_args: tuple[str, ...] = ()

    @property
    def worker_ids(self) -> list[str]:
        return [f"w{i}" for i in range(1, self.workers + 1)]


def is_pool_trace(path: str | Path) -> bool:
    """Whether a trace file is a pool trace (``"kind": "pool"``); False for anything unreadable (load_trace says why)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, Mapping) and data.get("kind") == "pool"


def load_pool_trace(path: str | Path) -> PoolTrace:
    """Read and validate a pool trace. Raises TraceError naming the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise TraceError(f"cannot read trace {str(p)!r}: {e.strerror}") from None
    except ValueError as e:
        raise TraceError(f"trace {str(p)!r} is not valid JSON: {e}") from None
    return parse_pool_trace(data, default_name=p.stem)


_NUMBERS = {"duration": 10.0, "min_residence": 0.0, "stop_timeout": 1.0, "handback_bound": 1.0,
            "matchmaking_time": 0.1, "utilisation_target": 0.0, "loss_tolerance": 0.0, "loss_abs_tolerance": 0.0}


def parse_pool_trace(data: Any, *, default_name: str = "pool") -> PoolTrace:
    """Validate a pool trace's plain form. Raises TraceError: an unknown key, a bad field, an impossible event."""
    if not isinstance(data, Mapping) or data.get("kind") != "pool":
        raise TraceError('a pool trace is a JSON object with "kind": "pool"')
    known = {"kind", "name", "task", "workers", "runs", "events", "peer_args", *_NUMBERS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TraceError(f"unknown pool trace key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    kw: dict[str, Any] = {"name": data.get("name", default_name)}
    if not isinstance(kw["name"], str) or not NAME_RE.match(kw["name"]):
        raise TraceError("name: 1-32 letters, digits, '-' or '_'")
    if "task" in data:
        if not isinstance(data["task"], str) or not data["task"]:
            raise TraceError("task: a task name")
        kw["task"] = data["task"]
    if "peer_args" in data:
        if not isinstance(data["peer_args"], list) or not all(isinstance(a, str) for a in data["peer_args"]):
            raise TraceError("peer_args: a list of strings")
        kw["peer_args"] = tuple(data["peer_args"])
    if "workers" in data:
        kw["workers"] = _int(data["workers"], "workers", lo=1)
    for key, lo in _NUMBERS.items():
        if key in data:
            kw[key] = _num(data[key], key, lo=lo)
    if kw.get("stop_timeout", 20.0) > 25.0:
        raise TraceError("stop_timeout: at most 25 s (the agent's bound: a resident gets the machine back in 30 s)")
    runs = data.get("runs")
    if not isinstance(runs, Mapping) or not runs:
        raise TraceError("runs: an object of run id -> {priority, min_peers, max_peers, sets}")
    kw["runs"] = {rid: _run(rid, spec) for rid, spec in runs.items()}
    events = data.get("events", [])
    if not isinstance(events, list):
        raise TraceError("events: a list")
    trace = PoolTrace(**kw)
    parsed = tuple(_event(e, f"events[{i}]", trace) for i, e in enumerate(events))
    submitted = [e.run for e in parsed if e.kind == "submit"]
    if len(set(submitted)) != len(submitted) or set(submitted) != set(trace.runs):
        raise TraceError("events: submit every run of runs exactly once")
    return PoolTrace(**{**kw, "events": parsed})


def _run(run_id: Any, spec: Any) -> PoolRunSpec:
    where = f"runs.{run_id}"
    if not isinstance(run_id, str) or not NAME_RE.match(run_id):
        raise TraceError(f"{where}: a run id of 1-32 letters, digits, '-' or '_'")
    if not isinstance(spec, Mapping):
        raise TraceError(f"{where}: an object")
    unknown = sorted(set(spec) - {"priority", "min_peers", "max_peers", "sets"})
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)}")
    lo = _int(spec.get("min_peers", 1), f"{where}.min_peers", lo=1)
    hi = _int(spec.get("max_peers", lo), f"{where}.max_peers", lo=lo)
    sets = spec.get("sets", {})
    if not isinstance(sets, Mapping) or not all(isinstance(k, str) for k in sets):
        raise TraceError(f"{where}.sets: an object of task arguments and hyperparameters")
    return PoolRunSpec(run_id=run_id, priority=_int(spec.get("priority", 1), f"{where}.priority", lo=0),
                       min_peers=lo, max_peers=hi, sets=dict(sets))


def _event(e: Any, where: str, trace: PoolTrace) -> PoolEvent:
    if not isinstance(e, Mapping):
        raise TraceError(f"{where}: an object with time or after, and kind")
    unknown = sorted(set(e) - {"time", "after", "kind", "run", "worker", "duration", "down"})
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kind = e.get("kind")
    if kind not in POOL_KINDS:
        raise TraceError(f"{where}.kind: {kind!r} is not one of {', '.join(POOL_KINDS)}")
    if ("time" in e) == ("after" in e):
        raise TraceError(f"{where}: give exactly one of time (seconds) and after ({{\"run\": ..., \"step\": ...}})")
    kw: dict[str, Any] = {"kind": kind, "source": where}
    if "time" in e:
        kw["time"] = _num(e["time"], f"{where}.time", lo=0.0)
    else:
        after = e["after"]
        if not isinstance(after, Mapping) or after.get("run") not in trace.runs:
            raise TraceError(f"{where}.after: {{\"run\": one of the trace's runs, \"step\": N}}")
        kw["after"] = (after["run"], _int(after.get("step"), f"{where}.after.step", lo=0))
    if kind == "submit":
        if e.get("run") not in trace.runs:
            raise TraceError(f"{where}.run: one of the trace's runs ({', '.join(trace.runs)})")
        kw["run"] = e["run"]
    elif kind == "resident":
        if e.get("worker") not in trace.worker_ids:
            raise TraceError(f"{where}.worker: one of {', '.join(trace.worker_ids)}")
        kw["worker"] = e["worker"]
        if "duration" in e:
            kw["duration"] = _num(e["duration"], f"{where}.duration", lo=0.1)
    else:
        kw["down"] = _num(e.get("down"), f"{where}.down", lo=0.0, hi=600.0)
    return PoolEvent(**kw)
