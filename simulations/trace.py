"""Traces: a run's scripted life as data (JSON), seeded and reproducible.

A trace names the task, the peers that start the run, and a list of **events** (time or step, peer, kind).
**Generators** expand into explicit events at load time with a ``random.Random`` seeded from the trace's
seed and the generator's index, so the same file and seed always give the same list
(``expand(trace) == expand(trace)``): exponential lifetimes with an MTBF, spot preemption waves, a lab's
diurnal workstations, a flash crowd. Faults are data, never code (STYLE.md 8 and 10).

An event fires at ``time`` seconds after the first peer listens, or when the swarm's newest committed step
reaches ``step`` (robust on a loaded machine). An event with ``group`` as well waits, past its time or step, for
the first step committed by a round of at least that many peers (a fault that must hit a swarm already training
together, whatever its joiners' speed). Kinds and their fields:

| kind | fields | what the runner does |
|---|---|---|
| ``join`` | ``peer`` (optional: a fresh name) | starts ``node join`` (a dead peer's name rejoins with its identity) |
| ``kill`` | ``peer`` | SIGKILL to the peer's process group |
| ``leave`` | ``peer`` | SIGTERM (graceful leave), SIGKILL after ``leave_timeout`` |
| ``stall`` | ``peer``, ``duration`` | SIGSTOP to the group, SIGCONT after ``duration`` |
| ``slow`` | ``peer``, ``rate`` (e.g. ``"2mbit"``), ``duration`` (optional) | ``tc tbf`` both ways on its veth |
| ``loss`` | ``peer``, ``percent``, ``duration`` (optional) | nftables drop rule on the receiving side |
| ``partition`` | ``peers`` (one side), ``duration`` (optional) | nftables drops between the two sides |
| ``latency`` | ``peer``, ``ms``, ``duration`` (optional) | the peer's delay proxy holds each direction ``ms`` |
| ``pause`` | ``duration``, ``peers`` (count on resume) | ``node pause``, then ``--resume-from`` on ``peers`` peers |

``peer`` may be ``"random"``: a live peer drawn at fire time from a seeded generator (peer0 is never drawn,
so the run keeps an address everyone knows). Link kinds need ``"links": true`` (each peer in its own network
namespace).

**Latency** needs no namespace and no root: with ``latency_ms`` (a one-way delay for every peer, 0 allowed) or
any ``latency`` event, each peer listens on a private port behind its own delay proxy
(:mod:`simulations.delayproxy`) and announces the proxy's address, so every connection dialed to it is
delayed each way; ``latency`` events change one peer's delay, and back to ``latency_ms`` after ``duration``.
A connection between two peers passes the proxy of the one that was dialed (p2pd dials announced addresses).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from swarmrun.protocol.errors import UsageError

KINDS = ("join", "kill", "leave", "stall", "slow", "loss", "partition", "pause", "latency")
LINK_KINDS = ("slow", "loss", "partition")
TARGETED = ("kill", "leave", "stall", "slow", "loss", "latency")
GENERATORS = ("mtbf", "spot", "diurnal", "flash_crowd")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")


class TraceError(UsageError):
    """A trace that cannot be run: the message names the field (``events[2].kind``) and what is wrong."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One scripted fault or join. Exactly one of ``time`` (seconds) and ``step`` is set."""

    kind: str
    time: Optional[float] = None
    step: Optional[int] = None
    peer: Optional[str] = None
    peers: Any = None  # partition: a list of names; pause: a count of peers on resume
    duration: Optional[float] = None
    rate: Optional[str] = None
    percent: Optional[float] = None
    ms: Optional[float] = None  # latency: the one-way delay
    group: Optional[int] = None  # also waits for a step committed by a round of at least this many peers
    source: str = "events"  # "events" or "generators[i]": where the event came from

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A parsed, validated trace (see the module docstring for the file format)."""

    name: str
    seed: int
    task: str = "synthetic"
    sets: Mapping[str, Any] = field(default_factory=dict)
    peers: int = 3  # started at once: peer0 creates the run, the others join
    min_peers: int = 1
    batch_size: int = 16
    matchmaking_time: float = 1.0
    duration: float = 300.0  # the runner stops the run after this many seconds whatever happens
    links: bool = False
    link_rate: Optional[str] = None  # every peer's link, when links is true (None: unshaped veth)
    leave_timeout: float = 30.0
    alone_after: Optional[float] = None  # every peer's --alone-after (None: the CLI's default)
    latency_ms: Optional[float] = None  # one-way delay of every peer's proxy; None (and no latency event): no proxies
    loss_tolerance: float = 0.02  # final eval loss vs the baseline's at equal samples (relative)
    loss_abs_tolerance: float = 0.0
    events: tuple[Event, ...] = ()
    generators: tuple[Mapping[str, Any], ...] = ()

    def expanded(self) -> list[Event]:
        """Explicit events plus the generators' events, ordered (steps first, then by time)."""
        return expand(self)

    @property
    def proxied(self) -> bool:
        """Whether every peer listens behind a delay proxy."""
        return self.latency_ms is not None or any(e.kind == "latency" for e in self.events)


def load_trace(path: str | Path, *, seed: Optional[int] = None) -> Trace:
    """Read and validate a trace file (JSON). ``seed`` overrides the file's.

    Raises:
        TraceError: unreadable file, bad JSON, or an invalid field (the message says which).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TraceError(f"cannot read trace {str(p)!r}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise TraceError(f"trace {str(p)!r} is not valid JSON: {e}") from None
    trace = parse_trace(data, default_name=p.stem)
    return replace(trace, seed=seed) if seed is not None else trace


def parse_trace(data: Any, *, default_name: str = "trace") -> Trace:
    """Validate a trace's plain form.

    Raises:
        TraceError: an unknown key, a missing or mistyped field, an impossible event.
    """
    if not isinstance(data, Mapping):
        raise TraceError("a trace must be a JSON object")
    known = {f for f in Trace.__dataclass_fields__}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TraceError(f"unknown trace key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if "seed" not in data:
        raise TraceError("seed: missing (a trace is reproducible only with a seed)")
    kw: dict[str, Any] = {"name": data.get("name", default_name), "seed": _int(data["seed"], "seed", lo=0)}
    if not isinstance(kw["name"], str) or not NAME_RE.match(kw["name"]):
        raise TraceError("name: 1-32 letters, digits, '-' or '_'")
    if "task" in data:
        kw["task"] = _str(data["task"], "task")
    if "sets" in data:
        if not isinstance(data["sets"], Mapping) or not all(isinstance(k, str) for k in data["sets"]):
            raise TraceError("sets: an object of task arguments and hyperparameters")
        kw["sets"] = dict(data["sets"])
    for key, lo in (("peers", 1), ("min_peers", 1), ("batch_size", 1)):
        if key in data:
            kw[key] = _int(data[key], key, lo=lo)
    for key, lo in (("matchmaking_time", 0.1), ("duration", 1.0), ("leave_timeout", 1.0),
                    ("loss_tolerance", 0.0), ("loss_abs_tolerance", 0.0), ("latency_ms", 0.0), ("alone_after", 0.0)):
        if key in data:
            kw[key] = _num(data[key], key, lo=lo)
    if "links" in data:
        if not isinstance(data["links"], bool):
            raise TraceError("links: true or false")
        kw["links"] = data["links"]
    if data.get("link_rate") is not None:
        kw["link_rate"] = _rate(data["link_rate"], "link_rate")
    events = data.get("events", [])
    if not isinstance(events, list):
        raise TraceError("events: a list")
    kw["events"] = tuple(parse_event(e, f"events[{i}]") for i, e in enumerate(events))
    gens = data.get("generators", [])
    if not isinstance(gens, list):
        raise TraceError("generators: a list")
    for i, g in enumerate(gens):
        _check_generator(g, f"generators[{i}]")
    kw["generators"] = tuple(dict(g) for g in gens)
    trace = Trace(**kw)
    for ev in trace.expanded():
        if ev.kind in LINK_KINDS and not trace.links:
            raise TraceError(f"{ev.source}: kind {ev.kind!r} needs \"links\": true (peers in network namespaces)")
    return trace


def parse_event(e: Any, where: str) -> Event:
    """One explicit event.

    Raises:
        TraceError: naming ``where`` and the field.
    """
    if not isinstance(e, Mapping):
        raise TraceError(f"{where}: an object with time or step, peer and kind")
    allowed = {"time", "step", "peer", "peers", "kind", "duration", "rate", "percent", "ms", "group"}
    unknown = sorted(set(e) - allowed)
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kind = e.get("kind")
    if kind not in KINDS:
        raise TraceError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    if ("time" in e) == ("step" in e):
        raise TraceError(f"{where}: give exactly one of time (seconds) and step")
    kw: dict[str, Any] = {"kind": kind, "source": where}
    if "time" in e:
        kw["time"] = _num(e["time"], f"{where}.time", lo=0.0)
    else:
        kw["step"] = _int(e["step"], f"{where}.step", lo=0)
    if kind in TARGETED:
        if "peer" not in e:
            raise TraceError(f"{where}.peer: kind {kind!r} needs a peer (a name or \"random\")")
    if "peer" in e:
        kw["peer"] = _name(e["peer"], f"{where}.peer")
    if "group" in e:
        kw["group"] = _int(e["group"], f"{where}.group", lo=1)
    if kind == "stall" and "duration" not in e:
        raise TraceError(f"{where}.duration: a stall needs a duration (seconds)")
    if "duration" in e:
        kw["duration"] = _num(e["duration"], f"{where}.duration", lo=0.1)
    if kind == "slow":
        kw["rate"] = _rate(e.get("rate"), f"{where}.rate")
    if kind == "loss":
        kw["percent"] = _num(e.get("percent"), f"{where}.percent", lo=0.0, hi=100.0)
    if kind == "latency":
        kw["ms"] = _num(e.get("ms"), f"{where}.ms", lo=0.0, hi=60_000.0)
    if kind == "partition":
        side = e.get("peers")
        if not isinstance(side, list) or not side:
            raise TraceError(f"{where}.peers: a partition needs a non-empty list of peer names (one side)")
        kw["peers"] = [_name(p, f"{where}.peers") for p in side]
    if kind == "pause":
        if "duration" not in e:
            raise TraceError(f"{where}.duration: a pause needs a duration (seconds until the resume)")
        kw["peers"] = _int(e.get("peers"), f"{where}.peers", lo=1)
    return Event(**kw)


# ---- generators ----------------------------------------------------------------------------------------
_GEN_FIELDS = {
    "mtbf": {"kind", "mtbf", "peers", "start", "end", "replace_after", "leave_fraction"},
    "spot": {"kind", "every", "start", "end", "fraction", "peers", "replace_after"},
    "diurnal": {"kind", "workstations", "period", "on_fraction", "start", "end", "jitter"},
    "flash_crowd": {"kind", "time", "count", "spread"},
}


def _check_generator(g: Any, where: str) -> None:
    if not isinstance(g, Mapping):
        raise TraceError(f"{where}: an object with a kind")
    kind = g.get("kind")
    if kind not in GENERATORS:
        raise TraceError(f"{where}.kind: {kind!r} is not one of {', '.join(GENERATORS)}")
    unknown = sorted(set(g) - _GEN_FIELDS[kind])
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)} for {kind!r} "
                         f"(known: {', '.join(sorted(_GEN_FIELDS[kind] - {'kind'}))})")
    if kind == "mtbf":
        _num(g.get("mtbf"), f"{where}.mtbf", lo=1.0)
        _num(g.get("leave_fraction", 0.0), f"{where}.leave_fraction", lo=0.0, hi=1.0)
        _names(g.get("peers"), f"{where}.peers")
    if kind == "spot":
        _num(g.get("every"), f"{where}.every", lo=1.0)
        _num(g.get("fraction", 0.33), f"{where}.fraction", lo=0.0, hi=1.0)
        _names(g.get("peers"), f"{where}.peers")
    if kind == "diurnal":
        _int(g.get("workstations"), f"{where}.workstations", lo=1)
        _num(g.get("period"), f"{where}.period", lo=2.0)
        _num(g.get("on_fraction", 0.5), f"{where}.on_fraction", lo=0.05, hi=1.0)
        _num(g.get("jitter", 0.0), f"{where}.jitter", lo=0.0)
    if kind == "flash_crowd":
        _num(g.get("time"), f"{where}.time", lo=0.0)
        _int(g.get("count"), f"{where}.count", lo=1)
        _num(g.get("spread", 0.0), f"{where}.spread", lo=0.0)
    for key in ("start", "end", "replace_after"):
        if g.get(key) is not None:
            _num(g[key], f"{where}.{key}", lo=0.0)
    if g.get("start") is not None and g.get("end") is not None and g["end"] <= g["start"]:
        raise TraceError(f"{where}: end must be after start")


def expand(trace: Trace) -> list[Event]:
    """The trace's events, generators expanded, in firing order (step events first by step, then by time)."""
    out = list(trace.events)
    for i, g in enumerate(trace.generators):
        rng = random.Random(f"{trace.seed}:{i}:{g['kind']}")  # str seeds hash deterministically (not hash())
        out.extend(_GENERATE[g["kind"]](g, rng, trace, f"generators[{i}]", f"g{i}"))
    return sorted(out, key=lambda e: (e.time is not None, e.step or 0, e.time or 0.0))


def _gen_mtbf(g, rng: random.Random, trace: Trace, src: str, prefix: str) -> list[Event]:
    """Each targeted peer lives an exponential time with mean ``mtbf``; it then crashes (or, with probability
    ``leave_fraction``, leaves) and, with ``replace_after``, a fresh machine joins that long after."""
    start, end = float(g.get("start", 0.0)), float(g.get("end", trace.duration))
    names = list(g.get("peers") or [f"peer{i}" for i in range(1, trace.peers)])
    out, k = [], 0
    for name in names:
        t, current = start, name
        while True:
            t += rng.expovariate(1.0 / float(g["mtbf"]))
            if t >= end:
                break
            kind = "leave" if rng.random() < float(g.get("leave_fraction", 0.0)) else "kill"
            out.append(Event(kind=kind, time=round(t, 3), peer=current, source=src))
            if g.get("replace_after") is None:
                break
            t += float(g["replace_after"])
            current, k = f"{prefix}p{k}", k + 1
            out.append(Event(kind="join", time=round(t, 3), peer=current, source=src))
    return out


def _gen_spot(g, rng: random.Random, trace: Trace, src: str, prefix: str) -> list[Event]:
    """Every ``every`` seconds a wave preempts ``fraction`` of the generator's live peers at once (SIGKILL,
    as a cloud reclaims a spot instance); each is replaced ``replace_after`` seconds later."""
    start, end = float(g.get("start", g["every"])), float(g.get("end", trace.duration))
    live = list(g.get("peers") or [f"peer{i}" for i in range(1, trace.peers)])
    out, k, t = [], 0, start
    while t < end and live:
        victims = sorted(rng.sample(live, max(1, round(float(g.get("fraction", 0.33)) * len(live)))))
        for v in victims:
            out.append(Event(kind="kill", time=round(t, 3), peer=v, source=src))
            live.remove(v)
            if g.get("replace_after") is not None:
                fresh, k = f"{prefix}p{k}", k + 1
                out.append(Event(kind="join", time=round(t + float(g["replace_after"]), 3), peer=fresh, source=src))
                live.append(fresh)
        t += float(g["every"])
    return out


def _gen_diurnal(g, rng: random.Random, trace: Trace, src: str, prefix: str) -> list[Event]:
    """``workstations`` lab machines, each on for ``on_fraction`` of every ``period`` (a compressed day), with
    a per-machine jitter; each leaves gracefully in the evening and rejoins with its identity the next day."""
    start, end = float(g.get("start", 0.0)), float(g.get("end", trace.duration))
    period, on = float(g["period"]), float(g.get("on_fraction", 0.5))
    jitter = float(g.get("jitter", 0.0))
    out = []
    for w in range(int(g["workstations"])):
        name = f"{prefix}ws{w}"
        day = start
        while day < end:
            up = day + rng.uniform(0.0, jitter)
            down = day + on * period + rng.uniform(0.0, jitter)
            if up < end:
                out.append(Event(kind="join", time=round(up, 3), peer=name, source=src))
                if down < end:
                    out.append(Event(kind="leave", time=round(down, 3), peer=name, source=src))
            day += period
    return out


def _gen_flash_crowd(g, rng: random.Random, trace: Trace, src: str, prefix: str) -> list[Event]:
    """``count`` fresh peers join within ``spread`` seconds of ``time``."""
    t0, spread = float(g["time"]), float(g.get("spread", 0.0))
    times = sorted(t0 + rng.uniform(0.0, spread) for _ in range(int(g["count"])))
    return [Event(kind="join", time=round(t, 3), peer=f"{prefix}p{k}", source=src) for k, t in enumerate(times)]


_GENERATE = {"mtbf": _gen_mtbf, "spot": _gen_spot, "diurnal": _gen_diurnal, "flash_crowd": _gen_flash_crowd}


# ---- field checks ---------------------------------------------------------------------------------------
def _int(v: Any, where: str, *, lo: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: an integer, got {v!r}")
    if lo is not None and v < lo:
        raise TraceError(f"{where}: must be >= {lo}, got {v}")
    return v


def _num(v: Any, where: str, *, lo: Optional[float] = None, hi: Optional[float] = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TraceError(f"{where}: a number, got {v!r}")
    if lo is not None and v < lo:
        raise TraceError(f"{where}: must be >= {lo:g}, got {v}")
    if hi is not None and v > hi:
        raise TraceError(f"{where}: must be <= {hi:g}, got {v}")
    return float(v)


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise TraceError(f"{where}: a non-empty string, got {v!r}")
    return v


def _name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not NAME_RE.match(v):
        raise TraceError(f"{where}: a peer name (1-32 letters, digits, '-', '_') or \"random\", got {v!r}")
    return v


def _names(v: Any, where: str) -> Optional[list[str]]:
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise TraceError(f"{where}: a non-empty list of peer names")
    return [_name(x, where) for x in v]


def _rate(v: Any, where: str) -> str:
    if not isinstance(v, str) or not RATE_RE.match(v):
        raise TraceError(f"{where}: a tc rate such as \"2mbit\" or \"500kbit\", got {v!r}")
    return v


def peer_names(events: Sequence[Event], initial: int) -> list[str]:
    """Every name the trace may start, in order of first appearance (initial peers first)."""
    names = [f"peer{i}" for i in range(initial)]
    for e in events:
        if e.kind == "join" and e.peer and e.peer not in names and e.peer != "random":
            names.append(e.peer)
    return names


def sample_budget_of(task: str, sets) -> bool:
    """Whether the trace's run ends on a sample budget (``total_samples`` or ``epochs``, set or the task's own)."""
    from swarmrun.protocol.errors import TaskError
    from swarmrun.protocol.spec import BUDGET_HPARAMS
    from swarmrun.node import load_task_class

    named = [k for k in BUDGET_HPARAMS if k in sets]
    if named:
        return named[0] != "total_steps"
    try:
        return any(k in load_task_class(task).hparam_defaults for k in BUDGET_HPARAMS[1:])
    except TaskError as e:
        raise UsageError(f"task {task!r}: {e}") from None


def default_hparam(task: str, key: str) -> int:
    from swarmrun.protocol.errors import TaskError
    from swarmrun.node import load_task_class

    try:
        return int(load_task_class(task).hparam_defaults[key])
    except (TaskError, KeyError) as e:
        raise UsageError(f"task {task!r}: {e}") from None
