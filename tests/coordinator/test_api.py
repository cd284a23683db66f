"""The HTTP JSON API in process (httpx.ASGITransport, no network), on SQLite and PostgreSQL."""

from __future__ import annotations

import httpx
import pytest

from swarmrun.coordinator.api import MAX_BODY_BYTES, make_app
from swarmrun.coordinator.registry import Registry

RESOURCES = {"devices": [{"kind": "cuda", "memory_gib": 24}], "cpus": 8, "ram_gib": 64}


class Pool:
    """An app over a registry with three users, and a client per user."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.changes = 0
        self.app = make_app(registry, on_change=self._changed)
        self.tokens = {name: registry.add_user(name) for name in ("alice", "bob")}
        self.tokens["root"] = registry.add_user("root", admin=True)

    def _changed(self) -> None:
        self.changes += 1

    def client(self, user: str | None = None, token: str | None = None) -> httpx.AsyncClient:
        token = token or (self.tokens[user] if user else None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://coordinator", headers=headers)


@pytest.fixture
def pool(registry) -> Pool:
    return Pool(registry)


def submission(run_id="big", **kw):
    return {"run_id": run_id, "task": "synthetic", "task_args": {"steps": 10}, "min_peers": 1, "max_peers": 4, **kw}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and isinstance(body["error"], str) and body["error"]


async def test_a_user_submits_reads_and_steers_their_run(pool):
    async with pool.client("alice") as alice:
        r = await alice.post("/api/runs", json=submission(priority="high", needs={"device": "cuda", "memory_gib": 16}))
        assert r.status_code == 201
        run = r.json()["run"]
        assert (run["run_id"], run["owner"], run["priority"], run["state"]) == ("big", "alice", 2, "pending")
        assert (run["need_device"], run["need_memory_gib"], run["task_args"]) == ("cuda", 16.0, {"steps": 10})
        assert [x["run_id"] for x in (await alice.get("/api/runs")).json()["runs"]] == ["big"]
        assert (await alice.get("/api/runs/big")).json()["run"]["workers"] == []
        assert (await alice.post("/api/runs/big/hold")).json()["run"]["state"] == "held"
        assert (await alice.get("/api/runs", params={"state": "held"})).json()["runs"][0]["run_id"] == "big"
        assert (await alice.get("/api/runs", params={"state": "pending,running"})).json()["runs"] == []
        assert (await alice.post("/api/runs/big/release")).json()["run"]["state"] == "pending"
        assert (await alice.patch("/api/runs/big", json={"priority": "low"})).json()["run"]["priority"] == 0
        assert (await alice.patch("/api/runs/big", json={"priority": 7})).json()["run"]["priority"] == 7
        assert (await alice.post("/api/runs/big/cancel")).json()["run"]["state"] == "cancelled"
        events = (await alice.get("/api/events")).json()["events"]
    assert [e["kind"] for e in events] == ["submit", "hold", "release", "priority", "priority", "cancel"]
    assert pool.changes == 6  # one per write, none per read


async def test_without_a_valid_token_it_is_401(pool):
    async with pool.client() as anonymous, pool.client(token="not-a-token") as stranger:
        for response in (
            await anonymous.get("/api/runs"),
            await anonymous.post("/api/runs", json=submission()),
            await stranger.get("/api/runs"),
            await stranger.post("/api/workers/register", json={"worker_id": "w", "hostname": "h"}),
            await anonymous.get("/api/runs", headers={"Authorization": f"Basic {pool.tokens['alice']}"}),
        ):
            assert_error(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
    assert pool.registry.runs() == [] and pool.registry.workers() == []


async def test_a_user_changes_only_their_own_runs_and_an_admin_all(pool):
    async with pool.client("alice") as alice, pool.client("bob") as bob, pool.client("root") as root:
        await alice.post("/api/runs", json=submission())
        assert (await bob.get("/api/runs/big")).status_code == 200  # everyone sees every run
        for response in (
            await bob.post("/api/runs/big/hold"),
            await bob.post("/api/runs/big/cancel"),
            await bob.patch("/api/runs/big", json={"priority": 2}),
            await bob.post("/api/runs/big/progress", json={"step": 1}),
        ):
            assert_error(response, 403, "forbidden")
        assert pool.registry.run("big")["state"] == "pending" and pool.registry.run("big")["step"] is None
        assert (await root.post("/api/runs/big/hold")).json()["run"]["state"] == "held"
        assert (await root.post("/api/runs/big/progress", json={"step": 3})).json()["run"]["step"] == 3


async def test_conflicts_are_409(pool):
    async with pool.client("alice") as alice:
        await alice.post("/api/runs", json=submission())
        assert_error(await alice.post("/api/runs", json=submission(task="char-lm")), 409, "conflict")
        assert (await alice.post("/api/runs/big/release")).json()["run"]["state"] == "pending"  # already so: no-op
        pool.registry.set_run_state("big", "running", expect="pending", reason="start")
        assert_error(await alice.post("/api/runs/big/release"), 409, "conflict")  # running, not held
        await alice.post("/api/runs/big/cancel")
        assert_error(await alice.post("/api/runs/big/hold"), 409, "conflict")
        assert_error(await alice.patch("/api/runs/big", json={"priority": 1}), 409, "conflict")
    assert pool.registry.run("big")["task"] == "synthetic"


@pytest.mark.parametrize(
    "body, field",
    [
        (submission(run_id="has space"), "run_id"),
        (submission(run_id="x" * 65), "run_id"),
        (submission(min_peers=3, max_peers=2), "min_peers"),
        (submission(min_peers=0), "min_peers"),
        (submission(priority="urgent"), "priority"),
        (submission(priority=True), "priority"),
        (submission(priority=1.5), "priority"),
        (submission(max_peer=3), "unknown field"),
        (submission(task_args=[1, 2]), "task_args"),
        (submission(share=0), "share"),
        ({"task": "synthetic"}, "missing"),
        ([1, 2], "JSON object"),
    ],
)
async def test_invalid_submissions_are_422_and_name_the_field(pool, body, field):
    async with pool.client("alice") as alice:
        response = await alice.post("/api/runs", json=body)
    assert_error(response, 422, "invalid")
    assert field in response.json()["error"]
    assert pool.registry.runs() == []


async def test_bodies_that_are_not_json_are_400(pool):
    async with pool.client("alice") as alice:
        deep = b"[" * 60_000  # under the size bound, over the decoder's recursion limit
        for content in (b"{", b"", b'{"run_id": "r", "task": "t", "share": NaN}', b"\xff", deep):
            assert_error(await alice.post("/api/runs", content=content), 400, "bad_json")
    assert pool.registry.runs() == []


async def test_a_body_over_the_bound_is_413_before_it_is_read_whole(pool):
    sent = 0

    async def long_stream():  # chunked: no Content-Length to refuse it by; 4 MiB if read whole
        nonlocal sent
        for _ in range(512):
            sent += 1
            yield b" " * 8192

    async with pool.client("alice") as alice:
        big = submission(task_args={"blob": "x" * MAX_BODY_BYTES})
        assert_error(await alice.post("/api/runs", json=big), 413, "too_large")
        assert_error(await alice.post("/api/runs", content=long_stream()), 413, "too_large")
    assert sent <= MAX_BODY_BYTES // 8192 + 2
    assert pool.registry.runs() == []


async def test_unknown_things_are_404_and_wrong_methods_405(pool):
    async with pool.client("alice") as alice:
        assert_error(await alice.get("/api/runs/nope"), 404, "not_found")
        assert_error(await alice.post("/api/runs/nope/hold"), 404, "not_found")
        assert_error(await alice.post("/api/workers/w9/heartbeat", json={"resident_present": False}), 404, "not_found")
        assert_error(await alice.get("/api/nothing"), 404, "not_found")
        assert_error(await alice.delete("/api/runs"), 405, "method_not_allowed")


async def test_an_agent_registers_beats_and_learns_its_assignment(pool):
    async with pool.client("alice") as alice, pool.client("bob") as agent, pool.client("root") as root:
        await alice.post("/api/runs", json=submission())
        r = await agent.post("/api/workers/register", json={"worker_id": "ws1", "hostname": "ws1.lab", "resources": RESOURCES})
        assert r.status_code == 200 and r.json()["assignment"] is None
        assert r.json()["worker"]["resources"]["devices"] == [{"kind": "cuda", "memory_gib": 24.0}]
        pool.registry.assign("ws1", "big")  # what the placement loop will do
        beat = (await agent.post("/api/workers/ws1/heartbeat", json={"resident_present": True})).json()
        assert beat["assignment"]["run_id"] == "big" and beat["assignment"]["task"] == "synthetic"
        assert beat["worker"]["resident_present"] is True
        # The agent of a worker in alice's run reports the run's progress; a stranger may not.
        progress = {"step": 4, "loss": 3.5, "samples_per_second": 120.5, "peers": 1, "snapshot": {"url": "file:///s", "step": 4}}
        run = (await agent.post("/api/runs/big/progress", json=progress)).json()["run"]
        assert (run["step"], run["loss"], run["snapshot_step"]) == (4, 3.5, 4)
        async with pool.client(token=pool.registry.add_user("carol")) as carol:
            assert_error(await carol.post("/api/runs/big/progress", json={"step": 5}), 403, "forbidden")
            assert_error(await carol.post("/api/workers/ws1/heartbeat", json={"resident_present": False}), 403, "forbidden")
            taken = {"worker_id": "ws1", "hostname": "evil", "resources": {}}
            assert_error(await carol.post("/api/workers/register", json=taken), 403, "forbidden")
        assert (await root.post("/api/workers/ws1/heartbeat", json={"resident_present": False})).status_code == 200
        workers = (await alice.get("/api/workers")).json()["workers"]
    assert [(w["worker_id"], w["hostname"], w["run_id"]) for w in workers] == [("ws1", "ws1.lab", "big")]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/workers/register", {"worker_id": "w/1", "hostname": "h"}),
        ("/api/workers/register", {"worker_id": "w1", "hostname": "h\x00"}),
        ("/api/workers/register", {"worker_id": "w1", "hostname": "h", "resources": {"cpus": 0}}),
        ("/api/workers/register", {"worker_id": "w1", "hostname": "h", "resources": {"devices": [{"memory_gib": 8}]}}),
        ("/api/runs/big/progress", {"step": -1}),
        ("/api/runs/big/progress", {"step": 1, "snapshot": {"url": "file:///s"}}),
        ("/api/runs/big/progress", {"step": 1, "loss": "low"}),
    ],
)
async def test_invalid_agent_reports_are_422(pool, path, body):
    async with pool.client("alice") as alice:
        await alice.post("/api/runs", json=submission())
        assert_error(await alice.post(path, json=body), 422, "invalid")
    assert pool.registry.workers() == [] and pool.registry.run("big")["step"] is None


async def test_events_page_by_cursor_and_filter_by_run(pool):
    async with pool.client("alice") as alice:
        for run_id in ("a", "b", "c"):
            await alice.post("/api/runs", json=submission(run_id))
        await alice.post("/api/runs/b/hold")
        page = (await alice.get("/api/events", params={"limit": 2})).json()
        assert [e["run_id"] for e in page["events"]] == ["a", "b"]
        rest = (await alice.get("/api/events", params={"since": page["next"]})).json()
        assert [(e["kind"], e["run_id"]) for e in rest["events"]] == [("submit", "c"), ("hold", "b")]
        assert (await alice.get("/api/events", params={"since": rest["next"]})).json() == {"events": [], "next": rest["next"]}
        only_b = (await alice.get("/api/events", params={"run_id": "b"})).json()["events"]
        assert [e["kind"] for e in only_b] == ["submit", "hold"]
        for params in ({"since": "x"}, {"since": -1}, {"limit": 0}, {"run_id": "a b"}):
            assert_error(await alice.get("/api/events", params=params), 422, "invalid")


async def test_what_the_api_wrote_is_served_again_after_a_restart(db_url, clock):
    first = Registry(db_url, clock=clock)
    token = first.add_user("alice")
    app = make_app(first)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c", headers=headers) as c:
        await c.post("/api/runs", json=submission())
        await c.post("/api/workers/register", json={"worker_id": "w1", "hostname": "h"})
        before = (await c.get("/api/runs/big")).json(), (await c.get("/api/events")).json()
    first.close()
    second = Registry(db_url, clock=clock)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(second)), base_url="http://c", headers=headers) as c:
        after = (await c.get("/api/runs/big")).json(), (await c.get("/api/events")).json()
    second.close()
    assert after == before and before[0]["run"]["run_id"] == "big"


async def test_an_assigned_workers_agent_gets_a_certificate_and_the_runs_signed_spec(pool, tmp_path):
    """Isolation through the API: a certificate only for a worker assigned to the run, signed with the run's owner
    key; the spec the leader's agent built is signed once, and a spec of another owner or policy is refused."""
    import base64
    import time

    from swarmrun.coordinator.agent import _unsigned_spec
    from swarmrun.node import verify_signature
    from swarmrun.protocol.access import admit
    from swarmrun.node.peer.access import read_certificate_file
    from swarmrun.protocol.spec import SignedSpec

    peer = "QmPeerOfW1xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
    async with pool.client("alice") as alice, pool.client("bob") as bob:
        assert (await alice.post("/api/runs", json=submission("r", task_args={"total_steps": 9}))).status_code == 201
        r = await alice.post("/api/workers/register", json={"worker_id": "w1", "hostname": "h", "resources": RESOURCES})
        assert r.status_code == 200 and r.json()["bootstrap"] == []
        body = {"worker_id": "w1", "peer_id": peer}
        assert_error(await alice.post("/api/runs/r/certificate", json=body), 403, "forbidden")  # not assigned yet
        pool.registry.assign("w1", "r")
        assert_error(await bob.post("/api/runs/r/certificate", json=body), 403, "forbidden")  # alice's worker
        assert_error(await alice.post("/api/runs/r/certificate", json={**body, "peer_id": "x/y"}), 422, "invalid")
        r = await alice.post("/api/runs/r/certificate", json=body)
        assert r.status_code == 200 and r.json()["spec"] is None
        owner_key = base64.b64decode(r.json()["owner_key"])
        (tmp_path / "invite").write_text(r.json()["certificate"])
        cert = read_certificate_file(tmp_path / "invite")
        assert admit(access="invite", run_id="r", owner_key=owner_key, peer_id=peer, credentials=cert, now=time.time(),
                     verifier=verify_signature) is None
        assignment = {"run_id": "r", "task": "synthetic", "task_args": {"total_steps": 9}}
        good = _unsigned_spec(assignment, owner_key)
        for bad in (_unsigned_spec(assignment, b"ssh-rsa AAAA another"), _unsigned_spec({**assignment, "run_id": "s"}, owner_key)):
            r = await alice.post("/api/runs/r/spec", json={"worker_id": "w1", "spec": base64.b64encode(bad).decode()})
            assert_error(r, 422, "invalid")
        r = await alice.post("/api/runs/r/spec", json={"worker_id": "w1", "spec": base64.b64encode(good).decode()})
        signed = SignedSpec.decode(base64.b64decode(r.json()["spec"]))
        signed.verify(verify_signature)
        assert signed.spec.owner_key == owner_key and signed.spec.access == "invite"
        again = await alice.post("/api/runs/r/certificate", json=body)
        assert again.json()["spec"] == r.json()["spec"]  # every later start gets the same spec
