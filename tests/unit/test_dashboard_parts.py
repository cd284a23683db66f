"""The dashboard's pure parts: the fold of the registry's events, the SVG helpers, a lone swarm's watch."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette

from swarmrun.coordinator import svg
from swarmrun.coordinator.history import History, Point, RunSeries, eta_seconds
from swarmrun.coordinator.swarm_page import SwarmWatch
from swarmrun.coordinator.web import run_routes


def ev(i, kind, t, run_id=None, worker_id=None, **detail):
    return {"id": i, "kind": kind, "time": t, "run_id": run_id, "worker_id": worker_id, "detail": detail}


EVENTS = [
    ev(1, "submit", 10.0, "big"), ev(2, "assign", 11.0, "big", "w1"), ev(3, "progress", 12.0, "big", step=1, loss=2.0),
    ev(4, "progress", 13.0, "big", step=2, loss=1.5, snapshot_url="file:///s", snapshot_step=2),
    ev(5, "resident_return", 14.0, "big", "w1"), ev(6, "unassign", 14.5, "big", "w1", reason="resident_return"),
    ev(7, "state", 15.0, "big", reason="pause", previous="running", state="paused"), ev(8, "resident_leave", 20.0, None, "w1"),
]


def test_history_folds_series_markers_and_spans_once():
    h = History()
    h.apply(EVENTS[:4])
    h.apply(EVENTS)  # a repeated batch (ids at or below the cursor) changes nothing
    s = h.runs["big"]
    assert [(p.step, p.loss) for p in s.points] == [(1, 2.0), (2, 1.5)] and s.snapshot_steps == [2]
    assert [m.label for m in s.markers] == ["snapshot @2", "resident back w1", "handed back w1", "pause"]
    assert [(x.run_id, x.start, x.end) for x in h.spans] == [("big", 11.0, 14.5), (None, 14.0, 20.0)]
    assert h.cursor == 8 and h.first_time == 10.0


def test_a_long_series_is_thinned_to_its_bound_keeping_the_newest_points():
    s = RunSeries()
    for i in range(1000):
        s.add(Point(time=float(i), step=i), max_points=100)
    assert len(s.points) <= 100 and s.points[-1].step == 999 and s.points[0].step == 0
    assert [p.step for p in s.points] == sorted(p.step for p in s.points)


def test_eta_from_the_recent_pace():
    points = [Point(time=float(t), step=2 * t) for t in range(10)]  # 2 steps a second
    assert eta_seconds(points, 38) == 10.0
    assert eta_seconds(points, None) is None and eta_seconds(points[:1], 38) is None
    assert eta_seconds(points, 10) == 0.0


def test_plot_draws_a_circle_per_point_and_escapes_labels():
    out = svg.plot([(1, 2.0), (2, 1.0), (3, 0.5)], title="loss <&>", x_label="step", y_label="loss",
                   marks=[svg.Mark(2, "<pause>")])
    assert out.count("<circle") == 3 and "<pause>" not in out and "&lt;pause&gt;" in out and "loss &lt;&amp;&gt;" in out
    assert "no data yet" in svg.plot([], title="t", x_label="x", y_label="y")
    assert svg.ticks(0, 1) == [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    assert len(set(svg.OKABE_ITO)) == 7 and svg.colour(7) == svg.colour(0)


def test_timeline_shades_resident_spans_and_labels_run_bars():
    out = svg.timeline(["w1", "w2"], [svg.Bar(0, 0, 50, "big", "#E69F00"), svg.Bar(1, 10, 20, "resident present", "", shade=True)],
                       start=0, end=100, title="t", x_fmt=str)
    assert out.count('class="bar"') == 1 and out.count('class="resident"') == 1 and ">big</text>" in out


def test_swarm_watch_marks_joins_leaves_and_serves_the_run_page():
    w = SwarmWatch("solo", task="synthetic", total_steps=100)
    peer = lambda p: {"peer_id": p, "role": "trainer"}  # noqa: E731
    w.observe(1.0, {"step": 1, "samples_per_second": 50.0, "peers": [peer("aaaa")], "blocks_applied": 4})
    w.observe(2.0, {"step": 1, "samples_per_second": 51.0, "peers": [peer("aaaa")]})  # nothing changed: no point
    w.observe(3.0, {"step": 2, "samples_per_second": 90.0, "peers": [peer("aaaa"), peer("bbbb")]})
    w.observe(4.0, {"step": 3, "samples_per_second": 45.0, "peers": [peer("bbbb")], "finished": True,
                    "providers": [{"peer_id": "bbbb", "step": 3}]})
    assert [p.step for p in w.series.points] == [1, 2, 3]
    assert [m.label for m in w.series.markers] == ["joined aaaa", "joined bbbb", "left aaaa", "finished"]
    row = w.run_row()
    assert row["state"] == "finished" and row["accounting"]["newest state served"] == "step 3 by 1 provider(s)"

    async def get(path):
        app = Starlette(routes=run_routes("solo", w.render))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash") as c:
            return await c.get(path)

    page, fragment = asyncio.run(get("/runs/solo")), asyncio.run(get("/ui/runs/solo"))
    assert page.status_code == 200 and 'data-fragment="/ui/runs/solo"' in page.text and "token-form" not in page.text
    assert fragment.status_code == 200 and fragment.text.count("<circle") == 6  # samples/s and peers, 3 points each


def test_a_run_page_draws_at_most_plot_points_per_plot_the_newest_included():
    from swarmrun.coordinator.web import PLOT_POINTS, run_fragment

    s = RunSeries()
    for i in range(1500):
        s.add(Point(time=float(i), step=i, loss=1.0 / (i + 1), samples_per_second=10.0, peers=2))
    out = run_fragment({"run_id": "r", "state": "running", "step": 1499, "total_steps": 3000}, s, colour=svg.colour(0))
    assert out.count("<circle") == 3 * PLOT_POINTS and "<title>1499: " in out


def test_history_keeps_eval_points_once_per_step_and_no_extra_point_for_an_eval_alone():
    h = History()
    h.apply([ev(1, "progress", 10.0, "r", step=5, loss=2.0, samples=320),
             ev(2, "progress", 10.5, "r", step=5, eval_step=5, eval_loss=1.8),
             ev(3, "progress", 10.6, "r", step=5, eval_step=5, eval_loss=1.9),  # another peer of the group: same step
             ev(4, "progress", 11.0, "r", step=6, loss=1.7, samples=384),
             ev(5, "progress", 12.0, "r", step=10, eval_step=10, eval_loss=1.2)])  # reported before its step's point
    s = h.runs["r"]
    assert [(e.step, e.loss) for e in s.evals] == [(5, 1.8), (10, 1.2)]
    assert [p.step for p in s.points] == [5, 6, 10]


def test_the_loss_plot_draws_eval_points_as_labelled_diamonds_at_their_samples():
    from swarmrun.coordinator.history import EvalPoint
    from swarmrun.coordinator.web import _samples_at, run_fragment

    known = [(1, 64), (2, 128), (4, 256)]
    assert _samples_at(known, 2) == 128 and _samples_at(known, 3) == 192 and _samples_at(known, 6) == 384
    assert _samples_at(known, 0) == 0 and _samples_at([(2, 100)], 4) == 200 and _samples_at([], 3) is None
    s = RunSeries()
    for i in range(1, 11):
        s.add(Point(time=float(i), step=i, loss=2.0 / i, samples=64 * i))
    s.evaluated(EvalPoint(5.5, 5, 0.5))
    s.evaluated(EvalPoint(10.5, 10, 0.25))
    out = run_fragment({"run_id": "r", "state": "running", "eval_loss": 0.25, "eval_step": 10, "owner": "a",
                        "accounting": {"blocks_applied": 10, "blocks_skipped": 0}}, s, colour=svg.colour(0))
    loss_plot = out[out.index('aria-label="loss against samples"'):out.index("</svg>")]
    assert loss_plot.count('class="overlay"') == 2 and loss_plot.count("<circle") == 10
    assert "<title>eval loss 320: 0.5</title>" in loss_plot and "<title>eval loss 640: 0.25</title>" in loss_plot
    assert 'class="legend"' in loss_plot and ">eval loss</text>" in loss_plot and ">training loss</text>" in loss_plot
    assert 'stroke="#000000"' in loss_plot  # black hollow diamonds: not one of the run colours, and another shape
    assert '<dd class="last-eval-loss">0.25 @ step 10</dd>' in out
    assert '<dd class="blocks-applied">10</dd>' in out and '<dd class="blocks-skipped">0</dd>' in out
    only_evals = RunSeries()
    only_evals.evaluated(EvalPoint(1.0, 5, 0.5))
    assert 'class="overlay"' in run_fragment({"run_id": "r", "state": "running"}, only_evals, colour=svg.colour(0))


def test_the_pool_table_shows_the_last_eval_loss_apart_from_the_training_loss():
    from swarmrun.coordinator.web import pool_fragment

    run = {"run_id": "r", "state": "running", "priority": 1, "owner": "a", "min_peers": 1, "max_peers": 2, "step": 10,
           "total_steps": 100, "samples_per_second": 5.0, "loss": 0.75, "eval_loss": 0.5, "eval_step": 10}
    out = pool_fragment([run, {**run, "run_id": "q", "eval_loss": None, "eval_step": None}], [], History(), 0.0)
    assert '<th scope="col">last eval loss</th>' in out
    assert '<td class="loss">0.75</td><td class="eval-loss">0.5 @ step 10</td>' in out
    assert '<td class="eval-loss">–</td>' in out


def _overlapping(labels):
    boxes = [(x - (w if anchor == "end" else 0), x + (0 if anchor == "end" else w), lane) for x, w, anchor, lane in labels]
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a[2] == b[2] and a[0] < b[1] and b[0] < a[1]]


def test_mark_labels_close_together_go_in_lanes_and_the_rest_are_thinned_keeping_their_tooltips():
    xs = [100.0, 104.0, 108.0, 112.0, 116.0, 120.0, 124.0, 400.0, 625.0]  # seven marks within 24 px, one at the edge
    labels = ["paused", "resumed", "preempted w1", "handed back w2", "held", "released", "resident back w3", "start",
              "finished"]
    places = svg.label_lanes(xs, labels)
    drawn = [(p[0], 6.5 * len(lab), p[1], p[2]) for p, lab in zip(places, labels) if p is not None]
    assert not _overlapping(drawn)
    assert sum(p is None for p in places) == 2 and places[0] is not None and places[7] == (403.0, "start", 0)
    assert places[8][1] == "end" and places[8][0] == 622.0  # near the right edge: drawn left of its line
    out = svg.plot([(x, 1.0) for x in range(100, 630, 10)], title="t", x_label="x", y_label="y",
                   marks=[svg.Mark(x, lab) for x, lab in zip(xs, labels)])
    assert out.count('<g class="mark">') == 7 and out.count('<g class="mark unlabelled">') == 2
    assert out.count('class="marklabel"') == 7 and all(f"<title>{lab}</title>" in out for lab in labels)
    assert out.index('class="marklabels"') > out.rindex("<line")  # labels over every mark's line, not under one
