"""The coordinator's HTTP JSON API: an ASGI app over a ``Registry``.

Users submit and steer runs; agents register workers, send heartbeats (and learn their
assignment from the answer), and get a certificate for the peer they start in the run they are assigned to, and
the run's signed spec (``coordinator/owner.py``: the coordinator holds every pool run's owner key); peers and agents report progress; the dashboard reads runs,
workers and events. Every request carries ``Authorization: Bearer TOKEN``: any user may read
everything, a user may change only their own runs and workers, an admin all of them.

Why each registry call goes through ``asyncio.to_thread``: the registry is a synchronous
SQLAlchemy engine (a commit may wait on an fsync), and the coordinator keeps one asyncio loop
(STYLE 4) that must not stall while it does.

Errors are JSON ``{"error": message, "code": code}``: 400 bad_json, 401 unauthorized,
403 forbidden, 404 not_found, 405 method_not_allowed, 409 conflict, 413 too_large,
422 invalid. A body is refused above ``max_body_bytes`` before it is read whole (bodies come
from the network, invariant 6).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from swarmrun.coordinator import schema
from swarmrun.coordinator.owner import b64, issue_certificate, public_owner_key, sign_spec
from swarmrun.coordinator.registry import RUN_STATES, Registry, User
from swarmrun.protocol.errors import Conflict, WorkerNotFound
from swarmrun.protocol.errors import AccessRefused, RunNotFound, SwarmrunError, UsageError

__all__ = ["MAX_BODY_BYTES", "make_app"]

MAX_BODY_BYTES = 64 * 1024
_EVENTS_LIMIT = 1000

# Most specific first: Conflict is a UsageError.
_ERROR_STATUS: list[tuple[type[SwarmrunError], int, str]] = [
    (AccessRefused, 403, "forbidden"),
    (Conflict, 409, "conflict"),
    (RunNotFound, 404, "not_found"),
    (WorkerNotFound, 404, "not_found"),
    (UsageError, 422, "invalid"),
]
_HTTP_CODES = {400: "bad_json", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def _error(status: int, code: str, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


async def _on_swarmrun_error(_request: Request, exc: Exception) -> JSONResponse:
    for cls, status, code in _ERROR_STATUS:
        if isinstance(exc, cls):
            return _error(status, code, str(exc))
    return _error(500, "internal", str(exc))


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, _HTTP_CODES.get(exc.status_code, "error"), exc.detail)


async def _on_internal_error(_request: Request, exc: Exception) -> JSONResponse:
    # The message stays in the server's log (Starlette re-raises it); the client learns only the kind.
    return _error(500, "internal", f"internal error ({type(exc).__name__})")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _Api:
    """The endpoints, bound to one registry. Each reads, checks, calls the registry in a thread."""

    def __init__(self, registry: Registry, on_change: Callable[[], None] | None, max_body_bytes: int,
                 store: str | None = None, bootstrap: tuple[str, ...] = ()) -> None:
        self.registry = registry
        self.bootstrap = list(bootstrap)
        self.on_change = on_change
        self.max_body_bytes = max_body_bytes
        self.store = store
        # worker id -> (run id, multiaddr or None while it starts) of the peer its agent runs. Kept in memory, not
        # in the registry: every heartbeat repeats it, so a restarted coordinator knows it again within one heartbeat
        self.peers: dict[str, tuple[str, str | None]] = {}
        self.heard: set[str] = set()  # workers heard from since this coordinator started

    async def with_run_info(self, worker_id: str, answer: dict[str, Any]) -> dict[str, Any]:
        """An agent's answer with what it needs to start its peer: the pool's store, the multiaddrs of the run's
        running peers on other workers, the run's leader and the run's last reported step.

        The leader creates or resumes the run; the others join a running peer. It is a worker whose peer of the run
        already runs, else the least worker id assigned; and nobody (everyone waits) while another assigned worker
        has not been heard from since this coordinator started: its peer may be training, and a second peer
        resuming the run from its snapshot would start a second swarm of it (the pool trace's exp2 stalled so,
        half in each, after a coordinator restart)."""
        assignment = answer.get("assignment")
        answer["store"] = self.store
        answer["bootstrap"] = self.bootstrap  # the coordinator's peer: every pool peer joins the DHT through it
        if assignment is None:
            return answer
        run = await self.call(self.registry.run, assignment["run_id"])
        members = run["workers"]
        others = [w for w in members if w != worker_id]
        running = sorted(w for w in others if self.peers.get(w, ("",))[0] == run["run_id"])
        assignment["peers"] = sorted(self.peers[w][1] for w in running if self.peers[w][1])
        if running:
            assignment["leader"] = running[0]
        elif any(w not in self.heard for w in others):
            assignment["leader"] = None
        else:
            assignment["leader"] = min(members) if members else worker_id
        assignment.update({k: run[k] for k in ("step", "total_steps", "snapshot_url", "snapshot_step")})
        return answer

    async def call(self, method: Callable, *args, **kwargs) -> Any:
        return await asyncio.to_thread(method, *args, **kwargs)

    async def write(self, method: Callable, *args, **kwargs) -> Any:
        """A registry write, then ``on_change`` (on the loop's thread, so it may set an asyncio.Event)."""
        result = await self.call(method, *args, **kwargs)
        if self.on_change is not None:
            self.on_change()
        return result

    async def user(self, request: Request) -> User:
        """The authenticated user, or 401."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 512:
            raise HTTPException(401, "an API token is needed: Authorization: Bearer TOKEN")
        user = await self.call(self.registry.authenticate, token)
        if user is None:
            raise HTTPException(401, "unknown API token")
        return user

    async def body(self, request: Request) -> Any:
        """The request's JSON body, refused with 413 past the bound before it is all read."""
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HTTPException(400, "bad Content-Length")
            if int(length) > self.max_body_bytes:
                raise HTTPException(413, f"body over {self.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked bodies have no Content-Length to trust
            size += len(chunk)
            if size > self.max_body_bytes:
                raise HTTPException(413, f"body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks), parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as e:
            raise HTTPException(400, f"the body is not valid JSON: {e}") from None

    async def owned_run(self, request: Request, user: User) -> str:
        """The path's run id, if ``user`` may change that run (its owner or an admin)."""
        run_id = schema.check_name(request.path_params["run_id"])
        run = await self.call(self.registry.run, run_id)
        if not user.admin and run["owner"] != user.name:
            raise AccessRefused(f"run {run_id!r} belongs to {run['owner']}; you may change only your own runs")
        return run_id

    async def owned_worker(self, worker_id: str, user: User, *, new_ok: bool) -> None:
        """Refuse (403) a worker registered by another user, (404) an unknown one unless ``new_ok``."""
        owner = await self.call(self.registry.worker_owner, worker_id)
        if owner is None and not new_ok:
            raise WorkerNotFound(f"no worker {worker_id!r} registered")
        if owner is not None and owner != user.name and not user.admin:
            raise AccessRefused(f"worker {worker_id!r} was registered by {owner}")

    # Runs

    async def submit(self, request: Request) -> JSONResponse:
        user = await self.user(request)
        sub = schema.parse_submission(await self.body(request))
        return JSONResponse({"run": await self.write(self.registry.submit, user.name, sub)}, status_code=201)

    async def list_runs(self, request: Request) -> JSONResponse:
        await self.user(request)
        states = request.query_params.get("state")
        if states is not None:
            states = tuple(states.split(","))
            if not set(states) <= set(RUN_STATES):
                raise UsageError(f"state must be among {', '.join(RUN_STATES)}")
        return JSONResponse({"runs": await self.call(self.registry.runs, states=states)})

    async def get_run(self, request: Request) -> JSONResponse:
        await self.user(request)
        run_id = schema.check_name(request.path_params["run_id"])
        return JSONResponse({"run": await self.call(self.registry.run, run_id)})

    def action(self, name: str) -> Callable:
        async def endpoint(request: Request) -> JSONResponse:
            user = await self.user(request)
            run_id = await self.owned_run(request, user)
            return JSONResponse({"run": await self.write(self.registry.user_action, run_id, name, by=user.name)})

        return endpoint

    async def patch_run(self, request: Request) -> JSONResponse:
        user = await self.user(request)
        run_id = await self.owned_run(request, user)
        priority = schema.parse_patch(await self.body(request))
        return JSONResponse({"run": await self.write(self.registry.set_priority, run_id, priority, by=user.name)})

    async def progress(self, request: Request) -> JSONResponse:
        user = await self.user(request)
        run_id = schema.check_name(request.path_params["run_id"])
        if not user.admin and user.name not in await self.call(self.registry.reporters, run_id):
            raise AccessRefused(f"only run {run_id!r}'s owner and the agents of its workers report its progress")
        report = schema.parse_progress(await self.body(request))
        return JSONResponse({"run": await self.write(self.registry.report_progress, run_id, report)})

    async def certificate(self, request: Request) -> JSONResponse:
        """A certificate for the peer an assigned worker starts (its peer id), the run's owner key (public) and,
        once signed, its spec."""
        user = await self.user(request)
        run_id = schema.check_name(request.path_params["run_id"])
        worker_id, peer_id = schema.parse_certificate_request(await self.body(request))
        await self.owned_worker(worker_id, user, new_ok=False)
        owned = await self.write(self.registry.certify, run_id, worker_id, peer_id)
        text = await self.call(issue_certificate, owned["owner_key"], run_id=run_id, peer_id=peer_id, now=time.time())
        return JSONResponse({"certificate": text, "owner_key": b64(await self.call(public_owner_key, owned["owner_key"])),
                             "spec": owned["signed_spec"] and b64(owned["signed_spec"])})

    async def spec(self, request: Request) -> JSONResponse:
        """Sign a new run's spec, built by the agent of a worker assigned to it; the first one signed stays."""
        user = await self.user(request)
        run_id = schema.check_name(request.path_params["run_id"])
        worker_id, unsigned = schema.parse_spec_request(await self.body(request))
        await self.owned_worker(worker_id, user, new_ok=False)
        run = await self.call(self.registry.run, run_id)
        if worker_id not in run["workers"]:
            raise AccessRefused(f"worker {worker_id!r} is not assigned to run {run_id!r}")
        owner_key = await self.call(self.registry.owner_key, run_id)
        signed = await self.call(sign_spec, owner_key, run_id=run_id, task=run["task"], unsigned=unsigned)
        return JSONResponse({"spec": b64(await self.write(self.registry.set_spec, run_id, signed))})

    # Workers

    async def register(self, request: Request) -> JSONResponse:
        user = await self.user(request)
        reg = schema.parse_registration(await self.body(request))
        await self.owned_worker(reg.worker_id, user, new_ok=True)
        answer = await self.write(self.registry.register_worker, reg, owner=user.name)
        self.heard.add(reg.worker_id)
        return JSONResponse(await self.with_run_info(reg.worker_id, answer))

    async def heartbeat(self, request: Request) -> JSONResponse:
        user = await self.user(request)
        worker_id = schema.check_name(request.path_params["worker_id"], "worker_id")
        await self.owned_worker(worker_id, user, new_ok=False)
        beat = schema.parse_heartbeat(await self.body(request))
        answer = await self.write(self.registry.heartbeat, worker_id, beat)
        self.heard.add(worker_id)
        if beat.peer_run_id is not None:
            self.peers[worker_id] = (beat.peer_run_id, beat.peer_maddr)
        else:
            self.peers.pop(worker_id, None)
        return JSONResponse(await self.with_run_info(worker_id, answer))

    async def list_workers(self, request: Request) -> JSONResponse:
        await self.user(request)
        return JSONResponse({"workers": await self.call(self.registry.workers)})

    async def events(self, request: Request) -> JSONResponse:
        await self.user(request)
        params = request.query_params
        try:
            since = int(params.get("since", "0"))
            limit = min(int(params.get("limit", str(_EVENTS_LIMIT))), _EVENTS_LIMIT)
        except ValueError:
            raise UsageError("since and limit must be integers") from None
        if since < 0 or limit < 1:
            raise UsageError("since must be >= 0 and limit >= 1")
        run_id = params.get("run_id")
        if run_id is not None:
            schema.check_name(run_id)
        events = await self.call(self.registry.events, since=since, limit=limit, run_id=run_id)
        return JSONResponse({"events": events, "next": events[-1]["id"] if events else since})


def make_app(
    registry: Registry, *, on_change: Callable[[], None] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
    store: str | None = None,
    pages: bool = False,
    bootstrap: tuple[str, ...] = (),
) -> Starlette:
    """The API as an ASGI app.

    Args:
        registry: where the state lives.
        on_change: called after every write (on the event loop's thread), e.g. to wake the
            placement loop without it polling.
        max_body_bytes: the largest request body accepted (413 above it).
        store: the pool's snapshot store, handed to agents (each run's snapshots go to ``STORE/RUN_ID``).
        pages: also serve the dashboard's pages (``coordinator/web.py``) on the same app.
        bootstrap: the multiaddrs of the coordinator's own peer, handed to agents for their peers' ``--peers``.
    """
    api = _Api(registry, on_change, max_body_bytes, store, bootstrap)
    routes = [
        Route("/api/runs", api.submit, methods=["POST"]),
        Route("/api/runs", api.list_runs, methods=["GET"]),
        Route("/api/runs/{run_id}", api.get_run, methods=["GET"]),
        Route("/api/runs/{run_id}", api.patch_run, methods=["PATCH"]),
        *(Route(f"/api/runs/{{run_id}}/{name}", api.action(name), methods=["POST"]) for name in ("hold", "release", "cancel")),
        Route("/api/runs/{run_id}/progress", api.progress, methods=["POST"]),
        Route("/api/runs/{run_id}/certificate", api.certificate, methods=["POST"]),
        Route("/api/runs/{run_id}/spec", api.spec, methods=["POST"]),
        Route("/api/workers", api.list_workers, methods=["GET"]),
        Route("/api/workers/register", api.register, methods=["POST"]),
        Route("/api/workers/{worker_id}/heartbeat", api.heartbeat, methods=["POST"]),
        Route("/api/events", api.events, methods=["GET"]),
    ]
    if pages:
        from swarmrun.coordinator.web import page_routes  # lazy: the dashboard is optional (STYLE 11)

        routes += page_routes(registry)
    handlers = {SwarmrunError: _on_swarmrun_error, HTTPException: _on_http_error, 500: _on_internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)
