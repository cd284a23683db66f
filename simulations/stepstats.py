"""Figures of a run's steps and rounds, as pure functions of the events the peers printed.

Shared by the harness report (``report.py``) and ``benchmarks/scaling.py``; no I/O, no torch, so they are unit-tested
on recorded events. Three figures:

- the **step size**: samples per committed step (the ``samples`` of the ``step`` events; every participant reports
  the same), its distribution and how far it strays from ``target_batch_size``;
- the **round overhead**: the share of a step's wall time between the swarm's reported samples reaching the target
  and the commit (the ``round_overhead_s`` field of each ``step`` event, over the time since that peer's previous
  ``step`` event); ``None`` when the peers do not report the field;
- the **abandoned rounds by reason**: the free-text ``reason`` of ``round_abandoned`` events, put in a few classes;
  every member of a group reports the round it abandoned, so the same figures also count each round once
  (``distinct_abandoned``).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

#: (class, lower-case fragments of the reason that put it there), tried in this order; anything else is "other"
ABANDON_CLASSES = (
    ("claims overlapped", ("overlap",)),
    ("not a majority", ("not a majority",)),
    ("could not find a group", ("could not find a group",)),
    ("fewer than target", ("fewer than target", "fewer than the step")),
    ("swarm moved on", ("swarmmovedon", "moved on", "committed this step before")),
    ("did not vote", ("did not vote",)),
    ("no accepted samples", ("no accepted samples",)),
    ("all-reduce incomplete", ("all-reduce incomplete", "incomplete all-reduce")),
    ("different gradient", ("different averaged gradient",)),
    ("timed out", ("timeout", "timed out")),
)
OTHER = "other"


def abandon_class(reason: object) -> str:
    """The class of one ``round_abandoned`` reason (see :data:`ABANDON_CLASSES`), ``"other"`` if none fits."""
    text = str(reason or "").lower()
    for name, fragments in ABANDON_CLASSES:
        if any(f in text for f in fragments):
            return name
    return OTHER


def abandoned_by_reason(reasons: Iterable[object]) -> dict[str, int]:
    """Abandoned rounds per reason class, the most frequent first (only classes that occurred)."""
    counts: dict[str, int] = {}
    for reason in reasons:
        cls = abandon_class(reason)
        counts[cls] = counts.get(cls, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def abandoned_round_key(event: Mapping, index: int) -> tuple:
    """What one abandoned round is: its group's id (``round``) at its step, else its members (6-character ids, from
    events of an earlier build) at its step; an attempt in which no group formed is this peer's own (``index``)."""
    step = event.get("step")
    if event.get("round"):
        return step, str(event["round"])
    if event.get("group"):
        return step, tuple(sorted(str(p) for p in event["group"]))
    return step, index


def distinct_abandoned(events: Iterable[Mapping]) -> dict[str, int]:
    """Abandoned rounds counted once each (not once per member that reported it), by reason class: the class of
    the first report of each round (members may word one failure differently: the one that saw it first, and the
    others that read its vote). ``total`` first, then the classes, the most frequent first."""
    first: dict[tuple, object] = {}
    for i, e in enumerate(events):
        first.setdefault(abandoned_round_key(e, i), e.get("reason"))
    return {"total": len(first), **abandoned_by_reason(first.values())}


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks (numpy's default); None if empty."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_sizes(step_events: Iterable[Mapping]) -> dict[int, int]:
    """Samples of each committed step: the first report of each step number that carries ``samples``."""
    out: dict[int, int] = {}
    for e in step_events:
        if e.get("samples") is not None and e.get("step") is not None:
            out.setdefault(int(e["step"]), int(e["samples"]))
    return out


def step_size_stats(sizes: Iterable[int], target: int) -> dict:
    """min / p50 / p95 / max / mean of the samples per step, and ``p95_error``: the 95th percentile of
    ``|samples - target| / target`` (None without steps or without a target)."""
    xs = [int(s) for s in sizes]
    errors = [abs(s - target) / target for s in xs] if target > 0 else []
    return dict(steps=len(xs), min=min(xs, default=None), p50=percentile(xs, 50), p95=percentile(xs, 95),
                max=max(xs, default=None), mean=(sum(xs) / len(xs)) if xs else None, target=target or None,
                p95_error=percentile(errors, 95))


def round_overhead(steps: Iterable[tuple[str, float, Mapping]]) -> dict:
    """The mean share of a step's wall time spent between the target being reached and the commit.

    Args:
        steps: ``(peer, time, step event)`` in any order; ``peer`` names one process (one incarnation), ``time``
            is when it printed the event.

    Returns:
        ``share``: the mean over steps of ``round_overhead_s`` / (time since the same peer's previous ``step``
        event), over the steps that follow that peer's previous step directly (so each peer's first step, and a
        step after a re-sync, are left out); ``steps``: how many steps it averages; ``reported``: whether any
        event carried ``round_overhead_s``. ``share`` is None when none did (the figure is then unknown, not 0).
    """
    by_peer: dict[str, list[tuple[float, Mapping]]] = {}
    reported = False
    for peer, t, e in steps:
        by_peer.setdefault(peer, []).append((float(t), e))
        reported = reported or e.get("round_overhead_s") is not None
    shares = []
    for rows in by_peer.values():
        rows.sort(key=lambda r: r[0])
        for (t0, prev), (t1, e) in zip(rows, rows[1:]):
            consecutive = e.get("step") is not None and prev.get("step") is not None \
                and int(e["step"]) == int(prev["step"]) + 1
            if consecutive and e.get("round_overhead_s") is not None and t1 > t0:
                shares.append(float(e["round_overhead_s"]) / (t1 - t0))
    return dict(share=(sum(shares) / len(shares)) if shares else None, steps=len(shares), reported=reported)
