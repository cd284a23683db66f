"""The run page of a swarm without a coordinator (``node dashboard``): its series folded from DHT reads.

A coordinator learns a run's life from its own events; a lone swarm has only the peers' live
progress reports in the DHT (no loss: the reports carry none). ``SwarmWatch.observe`` takes one
read of them (plain dicts, as ``node status`` gathers them) and keeps what the page plots: a
point when the step, the number of trainers or the pace changes, and a marker when a peer joins,
leaves or the run finishes. Pure: the caller gives the time; the DHT polling lives in
``swarmrun.node.cli.dashboard``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from swarmrun.coordinator.history import Marker, Point, RunSeries
from swarmrun.coordinator.svg import colour
from swarmrun.coordinator.web import run_fragment

__all__ = ["SwarmWatch"]


def _short(peer_id: str) -> str:
    return peer_id[-8:]


@dataclass
class SwarmWatch:
    """What ``node dashboard`` knows of one run: the newest read, and the series of all reads so far."""

    run_id: str
    task: str = "–"
    total_steps: Optional[int] = None
    series: RunSeries = field(default_factory=RunSeries)
    latest: dict[str, Any] = field(default_factory=dict)
    peers: set[str] = field(default_factory=set)
    finished: bool = False
    error: Optional[str] = None

    def observe(self, now: float, status: dict[str, Any]) -> None:
        """Fold one read of the swarm.

        Args:
            status: ``step``, ``samples_per_second``, ``finished``, ``peers`` (dicts with ``peer_id``,
                ``role``), and optionally the data accounting keys and ``providers``.
        """
        self.error = None
        trainers = {p["peer_id"] for p in status.get("peers", []) if p.get("role") == "trainer"}
        step = int(status.get("step") or 0)
        point = Point(time=now, step=step, samples_per_second=float(status.get("samples_per_second") or 0.0),
                      peers=len(trainers))
        last = self.series.points[-1] if self.series.points else None
        if last is None or (last.step, last.peers) != (point.step, point.peers) or \
                abs((last.samples_per_second or 0) - point.samples_per_second) > 0.1 * max(1.0, point.samples_per_second):
            self.series.add(point)
        for joined in sorted(trainers - self.peers):
            self.series.mark(Marker(now, "join", f"joined {_short(joined)}", step))
        for left in sorted(self.peers - trainers):
            self.series.mark(Marker(now, "leave", f"left {_short(left)}", step))
        if status.get("finished") and not self.finished:
            self.series.mark(Marker(now, "state", "finished", step))
        self.peers, self.finished, self.latest = trainers, bool(status.get("finished")), status

    def failed(self, message: str) -> None:
        """A read that failed: shown on the page, the series kept."""
        self.error = message

    def run_row(self) -> dict[str, Any]:
        """The run as ``run_fragment`` shows it (the fields a coordinator's registry would have)."""
        s = self.latest
        state = "finished" if self.finished else ("running" if self.peers else "no live trainer")
        accounting = {k: s[k] for k in ("data_epoch", "blocks_applied", "blocks_pending", "blocks_skipped",
                                        "blocks_duplicated") if s.get(k) is not None}
        providers = s.get("providers") or []
        if providers:
            accounting["newest state served"] = f"step {providers[0]['step']} by {len(providers)} provider(s)"
        if self.error:
            accounting["last read"] = f"failed: {self.error}"
        return dict(run_id=self.run_id, state=state, task=self.task, step=s.get("step"), total_steps=self.total_steps,
                    peers=len(self.peers), samples_per_second=s.get("samples_per_second"), accounting=accounting)

    def render(self) -> str:
        """The run page's fragment as it stands."""
        return run_fragment(self.run_row(), self.series, colour=colour(0))
