"""What the dashboard draws, folded from the registry's events: each run's series and the pool's timeline.

Why a fold kept in memory and not a query per page: a page polls every 2 s, and a long run has
many progress events. ``History.apply`` takes only the events after the last one it saw (the
registry's event ids commit in increasing order, so a cursor misses none), so a poll with
nothing new costs one indexed query. A series past ``max_points`` is thinned (every other
point of its older half dropped), which bounds memory and keeps the plot's shape. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

__all__ = ["Point", "EvalPoint", "Marker", "RunSeries", "Span", "History", "eta_seconds"]

MAX_POINTS = 2000
# The events marked on a run's plots, and the words shown for them.
_MARKED = {"hold": "held", "release": "released", "cancel": "cancelled", "resident_return": "resident back"}
_UNASSIGN_WORDS = {"preempt": "preempted", "resident_return": "handed back"}


@dataclass(frozen=True)
class Point:
    """One progress report: when, at which step, and what it said."""

    time: float
    step: int
    loss: Optional[float] = None
    samples_per_second: Optional[float] = None
    peers: Optional[int] = None
    samples: Optional[int] = None


@dataclass(frozen=True)
class EvalPoint:
    """A held-out evaluation of the run's model at ``step`` (the peers' ``eval`` event, forwarded by an agent)."""

    time: float
    step: int
    loss: float


@dataclass(frozen=True)
class Marker:
    """An event of a run's life marked on its plots: a pause, a resume, a preemption, a snapshot..."""

    time: float
    kind: str
    label: str
    step: Optional[int] = None


@dataclass
class RunSeries:
    """One run's progress points and marked events, oldest first."""

    points: list[Point] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)
    evals: list[EvalPoint] = field(default_factory=list)

    def evaluated(self, point: EvalPoint, max_points: int = MAX_POINTS) -> None:
        """Add an evaluation; one per step (every peer of a group evaluates the same state: the first one kept)."""
        if any(e.step == point.step for e in self.evals[-8:]):
            return
        self.evals.append(point)
        if len(self.evals) > max_points:
            half = len(self.evals) // 2
            self.evals = self.evals[:half:2] + self.evals[half:]

    def add(self, point: Point, max_points: int = MAX_POINTS) -> None:
        self.points.append(point)
        if len(self.points) > max_points:
            half = len(self.points) // 2
            self.points = self.points[:half:2] + self.points[half:]

    def mark(self, marker: Marker, max_markers: int = MAX_POINTS) -> None:
        self.markers.append(marker)
        del self.markers[:-max_markers]


@dataclass
class Span:
    """A worker's span of time in a run (``run_id``) or with its resident present (``run_id`` None)."""

    worker_id: str
    start: float
    end: Optional[float]  # None: still open
    run_id: Optional[str]


def _marker(event: dict[str, Any], step: Optional[int]) -> Optional[Marker]:
    kind, detail = event["kind"], event.get("detail") or {}
    if kind == "state":
        label = detail.get("reason") or detail.get("state", "state")
    elif kind == "unassign" and detail.get("reason") not in (None, "release"):
        label = f"{_UNASSIGN_WORDS.get(detail['reason'], detail['reason'])} {event.get('worker_id') or ''}".strip()
    elif kind in _MARKED:
        label = _MARKED[kind] + (f" {event['worker_id']}" if kind == "resident_return" and event.get("worker_id") else "")
    else:
        return None
    return Marker(time=event["time"], kind=kind, label=str(label), step=step)


class History:
    """The fold of the pool's events: ``runs[run_id]`` series, ``spans`` of workers, ``cursor`` (last event id)."""

    def __init__(self, *, max_points: int = MAX_POINTS) -> None:
        self.cursor = 0
        self.max_points = max_points
        self.runs: dict[str, RunSeries] = {}
        self.spans: list[Span] = []
        self.first_time: Optional[float] = None
        self._open: dict[tuple[str, bool], Span] = {}  # (worker, is resident span) -> its open span

    def series(self, run_id: str) -> RunSeries:
        return self.runs.setdefault(run_id, RunSeries())

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        """Fold events (oldest first, ids above ``cursor``) into the series and spans."""
        for event in events:
            if event["id"] <= self.cursor:
                continue
            self.cursor = event["id"]
            if self.first_time is None:
                self.first_time = event["time"]
            self._apply_one(event)

    def _apply_one(self, event: dict[str, Any]) -> None:
        kind, run_id, worker = event["kind"], event.get("run_id"), event.get("worker_id")
        detail = event.get("detail") or {}
        if kind == "progress" and run_id:
            series = self.series(run_id)
            if detail.get("eval_loss") is not None and detail.get("eval_step") is not None:
                series.evaluated(EvalPoint(event["time"], int(detail["eval_step"]), float(detail["eval_loss"])),
                                 self.max_points)
            reported = ("loss", "samples_per_second", "peers", "samples")
            # an evaluation of a step already plotted, with nothing else reported, is no new point
            if any(detail.get(k) is not None for k in reported) or not series.points or \
                    int(detail["step"]) > series.points[-1].step or detail.get("eval_loss") is None:
                series.add(Point(time=event["time"], step=int(detail["step"]), loss=detail.get("loss"),
                                 samples_per_second=detail.get("samples_per_second"), peers=detail.get("peers"),
                                 samples=detail.get("samples")), self.max_points)
            snap = detail.get("snapshot_step")
            if snap is not None and snap not in series.snapshot_steps[-1:]:
                series.snapshot_steps.append(int(snap))
                series.mark(Marker(event["time"], "snapshot", f"snapshot @{snap}", int(snap)), self.max_points)
        elif run_id:
            step = self.runs[run_id].points[-1].step if run_id in self.runs and self.runs[run_id].points else None
            marker = _marker(event, step)
            if marker is not None:
                self.series(run_id).mark(marker, self.max_points)
        if worker and kind in ("assign", "unassign"):
            self._span(worker, event["time"], run_id if kind == "assign" else None, resident=False, open_=kind == "assign")
        elif worker and kind in ("resident_return", "resident_leave"):
            self._span(worker, event["time"], None, resident=True, open_=kind == "resident_return")

    def _span(self, worker: str, time: float, run_id: Optional[str], *, resident: bool, open_: bool) -> None:
        current = self._open.pop((worker, resident), None)
        if current is not None:
            current.end = time
        if open_:
            span = Span(worker_id=worker, start=time, end=None, run_id=run_id)
            self._open[(worker, resident)] = span
            self.spans.append(span)


def eta_seconds(points: list[Point], total_steps: Optional[int], *, window: int = 20) -> Optional[float]:
    """Seconds to ``total_steps`` at the pace of the last ``window`` progress points; None if unknown."""
    if not total_steps or len(points) < 2:
        return None
    recent = points[-window:]
    first, last = recent[0], recent[-1]
    if last.step >= total_steps:
        return 0.0
    if last.time <= first.time or last.step <= first.step:
        return None
    return (total_steps - last.step) * (last.time - first.time) / (last.step - first.step)
