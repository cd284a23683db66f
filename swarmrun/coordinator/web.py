"""The dashboard: server-rendered pages of the pool, of each run and of the pool's timeline.

Routes (added to the API's Starlette app by ``make_app(..., pages=True)``):

- ``/``, ``/runs/{run_id}``, ``/timeline``: page shells (header, token form, the run page's
  action buttons). They hold no pool data, so they are served to anyone.
- ``/ui/pool``, ``/ui/runs/{run_id}``, ``/ui/timeline``: the pages' content as HTML fragments
  (tables, and plots as inline SVG drawn here). They need the same bearer token as the JSON
  API's reads: a browser has no way to put a header on a navigation, so the page's script
  (``web_assets/dashboard.js``) fetches the fragment with the token the user entered once
  (kept in localStorage), and again every 2 s, replacing the content only when it changed.
- ``/static/{name}``: the script and the stylesheet, from the package (no CDN: works offline).

Actions (hold, release, cancel, priority) are the JSON API's own endpoints, called by the
script with the token; the API decides who may change what.

Why fragments and not JSON rendered in the browser: the plots and tables are drawn once, in
Python, and the same code serves ``node dashboard`` (a swarm without a coordinator).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from html import escape
from importlib import resources
from string import Template
from typing import Any, Callable, Optional

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from swarmrun.coordinator import svg
from swarmrun.coordinator.history import History, RunSeries, eta_seconds
from swarmrun.coordinator.registry import Registry
from swarmrun.coordinator.schema import check_name

__all__ = ["POLL_SECONDS", "page_routes", "run_routes", "run_fragment", "shell"]

POLL_SECONDS = 2.0
PLOT_POINTS = 400  # drawn per plot: more are not seen at 640 px, and each costs the server and the browser
_STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_EVENTS_BATCH = 1000


def _asset(name: str) -> str:
    return resources.files("swarmrun.coordinator").joinpath("web_assets", name).read_text(encoding="utf-8")


def _clock_fmt(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def shell(*, title: str, fragment_url: str, nav: bool = True, actions: str = "", token_form: bool = True) -> str:
    """A page shell: the header, the token form, static controls, and the live region the script fills."""
    links = ('<nav aria-label="Dashboard pages"><a href="/">Pool</a> <a href="/timeline">Timeline</a></nav>'
             if nav else "")
    form = ('<form id="token-form" class="token"><label for="token">API token</label> '
            '<input id="token" name="token" type="password" autocomplete="off" size="24"> '
            '<button type="submit">Save token</button> <button type="button" id="forget-token">Forget token</button>'
            '</form>' if token_form else "")
    return Template(_asset("page.html")).substitute(
        title=escape(title), nav=links, token_form=form, actions=actions, fragment=escape(fragment_url, quote=True),
        interval=int(POLL_SECONDS * 1000))


def _actions(run_id: str) -> str:
    rid = escape(run_id, quote=True)
    buttons = "".join(f'<button type="button" data-action="{a}" data-run="{rid}">{label}</button> '
                      for a, label in (("hold", "Hold"), ("release", "Release"), ("cancel", "Cancel")))
    return (f'<section id="actions" aria-label="Actions on run {rid}"><h2>Actions</h2>{buttons}'
            f'<label for="priority">Priority</label> <input id="priority" type="number" min="0" step="1" size="4"> '
            f'<button type="button" data-action="priority" data-run="{rid}">Set priority</button></section>')


def _slug(key: str) -> str:
    """A fact's name as a CSS class: ``peers min / max`` -> ``peers-min-max`` (tests and styles find it)."""
    return "-".join("".join(c if c.isalnum() else " " for c in key.lower()).split())


def _swatch(colour: str) -> str:
    return f'<span class="swatch" style="background:{colour}" aria-hidden="true"></span>'


def _table(caption: str, headers: list[str], rows: list[str], table_id: str) -> str:
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in headers)
    body = "".join(rows) or f'<tr><td colspan="{len(headers)}">none</td></tr>'
    return f'<table id="{table_id}"><caption>{escape(caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _worker_rows(workers: list[dict], colours: dict[str, str], now: float) -> list[str]:
    rows = []
    for w in workers:
        run = w.get("run_id")
        doing = (f'training {_swatch(colours.get(run, "#999"))}<a href="/runs/{escape(run, quote=True)}">{escape(run)}</a>'
                 if run else "idle")
        devices = ", ".join(f'{d["kind"]} {d["memory_gib"]:g} GiB' for d in (w.get("resources") or {}).get("devices", []))
        rows.append(f'<tr id="worker-{escape(w["worker_id"], quote=True)}"><th scope="row">{escape(w["worker_id"])}</th>'
                    f'<td>{escape(w.get("hostname") or "")}</td><td class="doing">{doing}</td>'
                    f'<td class="resident">{"present" if w.get("resident_present") else "away"}</td>'
                    f'<td>{escape(devices or "cpu")}</td><td>{_duration(now - w["last_seen"])} ago</td></tr>')
    return rows


def _eval(run: dict) -> str:
    """A run's newest eval loss and its step ("0.4123 @ step 40"), or a dash."""
    if run.get("eval_loss") is None:
        return "–"
    return f'{_num(run["eval_loss"])} @ step {_num(run.get("eval_step"))}'


def _run_rows(runs: list[dict], assigned: dict[str, int], colours: dict[str, str], history: History) -> list[str]:
    rows = []
    for r in runs:
        rid = r["run_id"]
        eta = eta_seconds(history.series(rid).points, r.get("total_steps")) if r["state"] == "running" else None
        step = f'{_num(r.get("step"))} / {_num(r.get("total_steps"))}'
        rows.append(
            f'<tr id="run-{escape(rid, quote=True)}"><th scope="row">{_swatch(colours[rid])}'
            f'<a href="/runs/{escape(rid, quote=True)}">{escape(rid)}</a></th><td class="state">{escape(r["state"])}</td>'
            f'<td class="priority">{r["priority"]}</td><td>{escape(r["owner"])}</td>'
            f'<td class="peers">{assigned.get(rid, 0)} / {r["min_peers"]} / {r["max_peers"]}</td>'
            f'<td class="step">{step}</td><td>{_num(r.get("samples_per_second"))}</td><td>{_duration(eta)}</td>'
            f'<td class="loss">{_num(r.get("loss"))}</td><td class="eval-loss">{_eval(r)}</td></tr>')
    return rows


def pool_fragment(runs: list[dict], workers: list[dict], history: History, now: float) -> str:
    """The pool page's content: a summary line, the workers table and the runs table."""
    colours = {r["run_id"]: svg.colour(i) for i, r in enumerate(runs)}
    assigned: dict[str, int] = {}
    for w in workers:
        if w.get("run_id"):
            assigned[w["run_id"]] = assigned.get(w["run_id"], 0) + 1
    busy = sum(1 for w in workers if w.get("run_id"))
    present = sum(1 for w in workers if w.get("resident_present"))
    summary = (f'<p id="summary">{len(workers)} workers: {busy} training, {len(workers) - busy} idle, '
               f'{present} with their resident present. {len(runs)} runs.</p>')
    worker_table = _table("Workers", ["worker", "host", "doing", "resident", "devices", "last seen"],
                          _worker_rows(workers, colours, now), "workers")
    run_table = _table("Runs", ["run", "state", "priority", "owner", "peers now / min / max", "step / total",
                                "samples/s", "ETA", "last training loss", "last eval loss"], _run_rows(runs, assigned, colours, history), "runs")
    return summary + run_table + worker_table


def _thin(points: list, limit: int = PLOT_POINTS) -> list:
    """At most ``limit`` of ``points``, evenly spaced, the newest always kept."""
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    return [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]


def _samples_at(known: list[tuple[int, int]], step: int) -> Optional[float]:
    """The run's samples at ``step``, from ``known`` (step, samples) pairs in step order: exact, interpolated
    between neighbours, or at the pace of the nearest known step (an evaluation is reported before its step)."""
    if not known:
        return None
    i = bisect.bisect_left(known, (step, -1))
    if i < len(known) and known[i][0] == step:
        return float(known[i][1])
    if 0 < i < len(known):
        (s0, n0), (s1, n1) = known[i - 1], known[i]
        return n0 + (n1 - n0) * (step - s0) / (s1 - s0)
    s0, n0 = known[i - 1] if i else known[0]
    if len(known) >= 2:
        (a, na), (b, nb) = (known[-2], known[-1]) if i else (known[0], known[1])
        return n0 + (nb - na) / (b - a) * (step - s0) if b > a else None
    return n0 * step / s0 if s0 > 0 else None


def _loss_plot(series: RunSeries, colour: str) -> str:
    with_loss = _thin([p for p in series.points if p.loss is not None])
    by_samples = bool(with_loss) and all(p.samples is not None for p in with_loss)
    points = [(float(p.samples if by_samples else p.step), p.loss) for p in with_loss]
    evals: list[tuple[float, float]] = []
    if by_samples:
        known = sorted({p.step: p.samples for p in series.points if p.samples is not None}.items())
        for e in _thin(series.evals):
            x = _samples_at(known, e.step)
            if x is not None:
                evals.append((x, e.loss))
    else:
        evals = [(float(e.step), e.loss) for e in _thin(series.evals)]
    evals.sort()
    marks = [] if by_samples else [svg.Mark(s, f"snapshot @{s}", "#0072B2") for s in series.snapshot_steps[-5:]]
    overlay = svg.Overlay(evals, "eval loss") if series.evals else None
    return svg.plot(points, title="loss against " + ("samples" if by_samples else "step"),
                    x_label="samples" if by_samples else "step", y_label="loss", colour=colour, marks=marks,
                    overlay=overlay, label="training loss")


def _time_plots(series: RunSeries, colour: str) -> str:
    marks = [svg.Mark(m.time, m.label, "#D55E00" if m.kind in ("unassign", "resident_return") else "#555555")
             for m in series.markers[-12:] if m.kind != "snapshot"]
    sps = _thin([(p.time, p.samples_per_second) for p in series.points if p.samples_per_second is not None])
    peers = _thin([(p.time, float(p.peers)) for p in series.points if p.peers is not None])
    return (svg.plot(sps, title="samples per second over time", x_label="time", y_label="samples/s", colour=colour,
                     marks=marks, x_fmt=_clock_fmt)
            + svg.plot(peers, title="peers over time", x_label="time", y_label="peers", colour=colour, marks=marks,
                       x_fmt=_clock_fmt, step=True))


def run_fragment(run: dict, series: RunSeries, *, colour: str, assigned: Optional[list[str]] = None) -> str:
    """A run page's content: its figures, plots (loss, samples/s, peers) and the events of its life."""
    eta = eta_seconds(series.points, run.get("total_steps")) if run.get("state") == "running" else None
    snapshot = ("–" if run.get("snapshot_step") is None else
                f'step {run["snapshot_step"]} <code>{escape(str(run.get("snapshot_url") or ""))}</code>')
    pooled = "owner" in run  # a coordinator's run; a lone swarm's has no owner, priority, bounds nor loss
    facts = [("state", escape(str(run.get("state")))), ("task", escape(str(run.get("task", "–")))),
             ("step", f'{_num(run.get("step"))} / {_num(run.get("total_steps"))}'),
             ("peers reported", _num(run.get("peers"))), ("samples/s", _num(run.get("samples_per_second"))),
             ("ETA", _duration(eta))]
    if pooled:
        facts[1:1] = [("owner", escape(str(run["owner"]))), ("priority", _num(run.get("priority")))]
        facts += [("peers min / max", f'{_num(run.get("min_peers"))} / {_num(run.get("max_peers"))}'),
                  ("last training loss", _num(run.get("loss"))), ("last eval loss", _eval(run)),
                  ("snapshot", snapshot)]
    if assigned is not None:
        facts.append(("workers", escape(", ".join(assigned) or "none")))
    facts += [(k, escape(str(v))) for k, v in (run.get("accounting") or {}).items()]
    dl = "".join(f'<dt>{escape(k)}</dt><dd class="{_slug(k)}">{v}</dd>' for k, v in facts)
    events = [f'<tr><td>{_clock_fmt(m.time)}</td><td>{escape(m.label)}</td><td>{_num(m.step)}</td></tr>'
              for m in reversed(series.markers[-30:])]
    return (f'<dl id="facts">{dl}</dl><div class="plots">{_loss_plot(series, colour)}{_time_plots(series, colour)}</div>'
            + _table("Pauses, resumes, preemptions, snapshots (newest first)", ["time", "what", "step"], events, "events"))


def timeline_fragment(runs: list[dict], workers: list[dict], history: History, now: float) -> str:
    """The pool timeline: workers against time, spans coloured by run, the resident's presence hatched."""
    colours = {r["run_id"]: svg.colour(i) for i, r in enumerate(runs)}
    rows = [w["worker_id"] for w in workers]
    index = {w: i for i, w in enumerate(rows)}
    bars = [svg.Bar(row=index[s.worker_id], start=s.start, end=s.end if s.end is not None else now,
                    label=s.run_id or "resident present", fill=colours.get(s.run_id, "#999999"), shade=s.run_id is None)
            for s in history.spans if s.worker_id in index]
    start = history.first_time if history.first_time is not None else now - 60
    legend = "".join(f'<li>{_swatch(c)}<a href="/runs/{escape(r, quote=True)}">{escape(r)}</a></li>' for r, c in colours.items())
    return (svg.timeline(rows, bars, start=start, end=max(now, start + 1), title="workers against time, by run",
                         x_fmt=_clock_fmt)
            + f'<ul class="legend" aria-label="Run colours">{legend}<li><span class="swatch resident" aria-hidden="true">'
              f'</span>resident present (hatched)</li></ul>')


class _Pages:
    """The page and fragment endpoints over one registry, with the events' fold kept up to date."""

    def __init__(self, registry: Registry, clock: Callable[[], float]) -> None:
        self.registry, self.clock = registry, clock
        self.history = History()
        self._lock = asyncio.Lock()

    async def authorised(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 512:
            return False
        return await asyncio.to_thread(self.registry.authenticate, token) is not None

    async def refresh(self) -> None:
        """Fold the events written since the last refresh (one query when there are none)."""
        async with self._lock:
            while True:
                events = await asyncio.to_thread(self.registry.events, since=self.history.cursor, limit=_EVENTS_BATCH)
                self.history.apply(events)
                if len(events) < _EVENTS_BATCH:
                    return

    def fragment(self, render: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            if not await self.authorised(request):
                return JSONResponse({"error": "an API token is needed: Authorization: Bearer TOKEN", "code": "unauthorized"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await self.refresh()
            html = await render(request)
            return HTMLResponse(html, headers={"Cache-Control": "no-store"})

        return endpoint

    async def pool(self, _request: Request) -> str:
        runs, workers = await asyncio.gather(asyncio.to_thread(self.registry.runs), asyncio.to_thread(self.registry.workers))
        return pool_fragment(runs, workers, self.history, self.clock())

    async def run(self, request: Request) -> str:
        run_id = check_name(request.path_params["run_id"])
        run, runs = await asyncio.gather(asyncio.to_thread(self.registry.run, run_id), asyncio.to_thread(self.registry.runs))
        index = next(i for i, r in enumerate(runs) if r["run_id"] == run_id)
        return run_fragment(run, self.history.series(run_id), colour=svg.colour(index), assigned=run["workers"])

    async def timeline(self, _request: Request) -> str:
        runs, workers = await asyncio.gather(asyncio.to_thread(self.registry.runs), asyncio.to_thread(self.registry.workers))
        return timeline_fragment(runs, workers, self.history, self.clock())


async def _static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _STATIC:
        return JSONResponse({"error": f"no static file {name!r}", "code": "not_found"}, status_code=404)
    return Response(_asset(name), media_type=_STATIC[name], headers={"Cache-Control": "max-age=300"})


def _page(title: Callable[[Request], str], url: Callable[[Request], str], actions=None, **kw) -> Callable:
    async def endpoint(request: Request) -> HTMLResponse:
        extra = actions(request) if actions else ""
        return HTMLResponse(shell(title=title(request), fragment_url=url(request), actions=extra, **kw))

    return endpoint


def _run_id(request: Request) -> str:
    return check_name(request.path_params["run_id"])


def page_routes(registry: Registry, *, clock: Callable[[], float] = time.time) -> list[Route]:
    """The dashboard's routes over a registry (``make_app(..., pages=True)`` mounts them)."""
    pages = _Pages(registry, clock)
    return [
        Route("/", _page(lambda r: "swarmrun pool", lambda r: "/ui/pool"), methods=["GET"]),
        Route("/timeline", _page(lambda r: "swarmrun pool timeline", lambda r: "/ui/timeline"), methods=["GET"]),
        Route("/runs/{run_id}", _page(lambda r: f"run {_run_id(r)}", lambda r: f"/ui/runs/{_run_id(r)}",
                                      actions=lambda r: _actions(_run_id(r))), methods=["GET"]),
        Route("/ui/pool", pages.fragment(pages.pool), methods=["GET"]),
        Route("/ui/runs/{run_id}", pages.fragment(pages.run), methods=["GET"]),
        Route("/ui/timeline", pages.fragment(pages.timeline), methods=["GET"]),
        Route("/static/{name}", _static, methods=["GET"]),
    ]


def run_routes(run_id: str, render: Callable[[], str]) -> list[Route]:
    """The run page alone, for ``node dashboard``: open to whoever reaches its address (no users, no actions).

    Args:
        render: returns the run page's fragment as it stands (called on each poll).
    """
    async def fragment(_request: Request) -> HTMLResponse:
        return HTMLResponse(render(), headers={"Cache-Control": "no-store"})

    page = _page(lambda r: f"run {run_id}", lambda r: f"/ui/runs/{run_id}", nav=False, token_form=False)
    return [
        Route("/", lambda r: RedirectResponse(f"/runs/{run_id}"), methods=["GET"]),
        Route(f"/runs/{run_id}", page, methods=["GET"]),
        Route(f"/ui/runs/{run_id}", fragment, methods=["GET"]),
        Route("/static/{name}", _static, methods=["GET"]),
    ]
