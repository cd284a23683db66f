"""The coordinator's glue, on SQLite: registry rows -> placement's dataclasses, placement's actions -> the registry;
the agent's view of its assignment through the API; the resident sources."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from swarmrun.coordinator.api import make_app
from swarmrun.coordinator.placement import Assign, Needs, Pause, Policy, Release, Resume, RunState
from swarmrun.coordinator.registry import Registry
from swarmrun.coordinator.residents import FileResident, ScriptResident, flag_path, make_resident
from swarmrun.coordinator.schema import Heartbeat, Registration, Resources, Submission
from swarmrun.coordinator.service import carry_out, finished_runs, parse_http, place_once, placement_view
from swarmrun.protocol.errors import UsageError

from .conftest import FakeClock

CPU = Resources(cpus=4, ram_gib=16.0)
GPU = Resources(devices=(("cuda", 24.0), ("cuda", 80.0)), cpus=16, ram_gib=64.0)
GIB = 2**30


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def registry(tmp_path, clock):
    r = Registry(f"sqlite:///{tmp_path / 'c.db'}", clock=clock)
    r.add_user("alice")
    yield r
    r.close()


def submit(registry, run_id, **kw):
    kw.setdefault("task", "synthetic")
    kw.setdefault("task_args", {})
    return registry.submit("alice", Submission(run_id=run_id, **kw))


def worker(registry, worker_id, resources=CPU):
    registry.register_worker(Registration(worker_id=worker_id, hostname="h", resources=resources), owner="alice")


def test_rows_become_placement_records(registry, clock):
    submit(registry, "big", priority=0, min_peers=2, max_peers=4, share=2.0, need_device="cuda", need_memory_gib=40.0)
    clock.advance()
    submit(registry, "small", priority=2)
    worker(registry, "w1", GPU)
    worker(registry, "w2")
    registry.heartbeat("w2", Heartbeat(resident_present=True))
    registry.assign("w1", "big")
    runs, workers, assignments = placement_view(registry.pool())
    assert [r.run_id for r in runs] == ["big", "small"]
    big = runs[0]
    assert (big.priority, big.min_peers, big.max_peers, big.share, big.state) == (0, 2, 4, 2.0, RunState.PENDING)
    assert big.needs == Needs(device="cuda", min_memory=40 * GIB) and runs[1].needs == Needs()
    by_id = {w.worker_id: w for w in workers}
    assert by_id["w1"].devices == {"cpu": 64 * GIB, "cuda": 24 * GIB}  # the smallest GPU bounds what a peer may use
    assert by_id["w2"].devices == {"cpu": 16 * GIB} and by_id["w2"].resident_present
    assert [(a.worker_id, a.run_id, a.since) for a in assignments] == [("w1", "big", clock.now)]


def test_a_placement_pass_starts_a_run_and_a_resident_return_releases_its_worker(registry, clock):
    submit(registry, "r", min_peers=1, max_peers=2)
    worker(registry, "w1")
    worker(registry, "w2")
    seen = []
    assert place_once(registry, Policy(), clock.now, lambda kind, **f: seen.append((kind, f))) == 3  # resume + 2 assigns
    run = registry.run("r")
    assert run["state"] == "running" and run["workers"] == ["w1", "w2"]
    assert [f["action"] for _, f in seen] == ["resume", "assign", "assign"]
    assert place_once(registry, Policy(), clock.now, lambda *a, **k: None) == 0  # nothing left to do
    clock.advance(1)
    registry.heartbeat("w2", Heartbeat(resident_present=True))
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    assert registry.run("r")["workers"] == ["w1"] and registry.run("r")["state"] == "running"
    unassigns = [e for e in registry.events() if e["kind"] == "unassign"]
    assert [(e["worker_id"], e["detail"]["reason"]) for e in unassigns] == [("w2", "resident returned")]


def test_a_run_below_its_minimum_is_paused_and_its_workers_released(registry, clock):
    submit(registry, "r", min_peers=2, max_peers=2)
    worker(registry, "w1")
    worker(registry, "w2")
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    assert registry.run("r")["state"] == "running"
    clock.advance(1)
    registry.heartbeat("w1", Heartbeat(resident_present=True))
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    run = registry.run("r")
    assert run["state"] == "paused" and run["workers"] == []
    states = [(e["detail"]["previous"], e["detail"]["state"]) for e in registry.events() if e["kind"] == "state"]
    assert states == [("pending", "running"), ("running", "paused")]


def test_carry_out_stops_at_a_conflict_and_keeps_a_users_hold(registry, clock):
    submit(registry, "r")
    worker(registry, "w1")
    runs, _, _ = placement_view(registry.pool())
    registry.user_action("r", "hold", by="alice")  # lands between the loop's read and its write
    actions = [Resume(run_id="r", reason="capacity"), Assign(worker_id="w1", run_id="r", reason="free")]
    assert carry_out(registry, actions, runs) == 0
    assert registry.run("r")["state"] == "held" and registry.run("r")["workers"] == []


def test_carry_out_records_each_kind_of_action(registry, clock):
    submit(registry, "r")
    worker(registry, "w1")
    runs, _, _ = placement_view(registry.pool())
    assert carry_out(registry, [Resume(run_id="r", reason="x"), Assign(worker_id="w1", run_id="r", reason="y")], runs) == 2
    runs, _, _ = placement_view(registry.pool())
    assert carry_out(registry, [Pause(run_id="r", reason="p"), Release(worker_id="w1", run_id="r", reason="q")], runs) == 2
    assert registry.run("r")["state"] == "paused" and registry.run("r")["workers"] == []


def test_a_run_that_reached_its_last_step_is_finished(registry, clock):
    from swarmrun.coordinator.schema import Progress

    submit(registry, "r", total_steps=3)
    worker(registry, "w1")
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    registry.report_progress("r", Progress(step=2))
    assert finished_runs(registry.pool()) == []
    registry.report_progress("r", Progress(step=3))
    assert finished_runs(registry.pool()) == ["r"]
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    assert registry.run("r")["state"] == "finished" and registry.run("r")["workers"] == []


async def test_an_agent_learns_the_store_the_leader_and_the_peers_of_its_run(registry, clock):
    token = registry.add_user("bob")
    submit(registry, "r", max_peers=2)
    app = make_app(registry, store="/pool/store")
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c", headers=headers) as c:
        for w in ("w2", "w1"):
            body = {"worker_id": w, "hostname": "h", "resources": {"cpus": 2}}
            assert (await c.post("/api/workers/register", json=body)).json()["store"] == "/pool/store"
        place_once(registry, Policy(), clock.now, lambda *a, **k: None)
        beat = {"resident_present": False, "peer": {"run_id": "r", "maddr": "/ip4/127.0.0.1/tcp/1/p2p/Qm1"}}
        first = (await c.post("/api/workers/w1/heartbeat", json=beat)).json()["assignment"]
        assert first["leader"] == "w1" and first["peers"] == [] and first["state"] == "running"
        second = (await c.post("/api/workers/w2/heartbeat", json={"resident_present": False})).json()["assignment"]
        assert second["peers"] == ["/ip4/127.0.0.1/tcp/1/p2p/Qm1"] and second["leader"] == "w1"
        await c.post("/api/workers/w1/heartbeat", json={"resident_present": False})  # its peer stopped
        second = (await c.post("/api/workers/w2/heartbeat", json={"resident_present": False})).json()["assignment"]
        assert second["peers"] == [] and second["leader"] == "w1"
        # a peer that runs but does not listen yet: the others wait for it instead of leading a second swarm
        starting = {"resident_present": False, "peer": {"run_id": "r"}}
        assert (await c.post("/api/workers/w2/heartbeat", json=starting)).status_code == 200
        first = (await c.post("/api/workers/w1/heartbeat", json={"resident_present": False})).json()["assignment"]
        assert first["peers"] == [] and first["leader"] == "w2"
        bad = await c.post("/api/workers/w1/heartbeat", json={"resident_present": False, "peer": {"maddr": "/ip4/x"}})
        assert bad.status_code == 422


async def test_a_restarted_coordinator_names_no_leader_until_it_heard_every_worker_of_the_run(registry, clock):
    """A coordinator restarted on the same database knows the assignments but not yet which peers run: a worker
    that led the run's resume before the others' first heartbeat started a second swarm of the run (exp2 of the
    pool trace, half its peers in each, stalled for good)."""
    token = registry.add_user("bob")
    submit(registry, "r", max_peers=2)
    headers = {"Authorization": f"Bearer {token}"}
    app = make_app(registry, store="/pool/store")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c", headers=headers) as c:
        for w in ("w2", "w1"):
            await c.post("/api/workers/register", json={"worker_id": w, "hostname": "h", "resources": {"cpus": 2}})
        place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    restarted = make_app(registry, store="/pool/store")  # same database, nothing in memory
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=restarted), base_url="http://c",
                                 headers=headers) as c:
        first = (await c.post("/api/workers/w1/heartbeat", json={"resident_present": False})).json()["assignment"]
        assert first["leader"] is None and first["peers"] == []  # w2 may be training: wait for its heartbeat
        beat = {"resident_present": False, "peer": {"run_id": "r", "maddr": "/ip4/127.0.0.1/tcp/2/p2p/Qm2"}}
        await c.post("/api/workers/w2/heartbeat", json=beat)
        first = (await c.post("/api/workers/w1/heartbeat", json={"resident_present": False})).json()["assignment"]
        assert first["leader"] == "w2" and first["peers"] == ["/ip4/127.0.0.1/tcp/2/p2p/Qm2"]


def test_resident_sources(tmp_path):
    now = [0.0]
    script = ScriptResident([[30, True], [0, False], [60, False]], clock=lambda: now[0])
    seen = []
    for t in (0, 29.9, 30, 59, 61):
        now[0] = t
        seen.append(script.present())
    assert seen == [False, False, True, True, False]
    flag = FileResident(flag_path(tmp_path))
    assert not flag.present()
    flag_path(tmp_path).touch()
    assert flag.present()
    (tmp_path / "s.json").write_text(json.dumps([[0, True]]))
    assert make_resident(f"script:{tmp_path / 's.json'}", tmp_path).present()
    for bad in ("script:/nonexistent", "nope", "idle:x"):
        with pytest.raises(UsageError):
            make_resident(bad, tmp_path)


def test_parse_http():
    assert parse_http("0.0.0.0:8470") == ("0.0.0.0", 8470)
    assert parse_http("[::1]:80") == ("::1", 80)
    for bad in ("8470", "host:", ":80", "h:99999"):
        with pytest.raises(UsageError):
            parse_http(bad)


class _Recorder:
    def __init__(self):
        self.seen = []

    def emit(self, kind, **fields):
        self.seen.append((kind, fields))


def _agent(tmp_path, store=None, **config):
    from swarmrun.coordinator.agent import Agent, AgentConfig

    agent = Agent(AgentConfig(worker_id="w1", state_dir=tmp_path, **config), client=None,
                  resident=FileResident(flag_path(tmp_path)), events=_Recorder())
    agent.store = store
    agent.started = []

    async def start_peer(run_id, args, **kw):
        agent.started.append(args)

    agent.start_peer = start_peer
    return agent


def _assignment(**kw):
    base = dict(run_id="r", state="running", task="synthetic", task_args={"total_steps": "9"}, peers=[], leader="w1",
                step=None, since=1.0)
    return {"assignment": {**base, **kw}}


class _Owner:
    """The coordinator's side of an agent's admission, without HTTP: a certificate for any peer id, one signed spec."""

    def __init__(self):
        from swarmrun.coordinator.owner import new_owner_key

        self.key, self.spec, self.posts = new_owner_key(), None, []

    def post(self, path, body=None):
        import base64
        import time

        from swarmrun.coordinator.owner import b64, issue_certificate, public_owner_key, sign_spec

        self.posts.append((path, body))
        _, run_id, what = path.split("/")
        if what == "certificate":
            text = issue_certificate(self.key, run_id=run_id, peer_id=body["peer_id"], now=time.time())
            return {"certificate": text, "owner_key": b64(public_owner_key(self.key)), "spec": self.spec}
        assert self.spec is None, "a run's spec is signed once"
        self.spec = b64(sign_spec(self.key, run_id=run_id, task="synthetic", unsigned=base64.b64decode(body["spec"])))
        return {"spec": self.spec}


def _certified_peer(args) -> str:
    from swarmrun.node.peer.access import read_certificate_file
    from swarmrun.protocol.access import Certificate

    return Certificate.decode(read_certificate_file(args[args.index("--invite") + 1])).peer_id


async def test_the_leader_creates_a_new_run_and_the_others_join_a_running_peer(tmp_path):
    """The leader starts the run from a spec the coordinator signed (its owner key, invite-only); every peer starts
    with a certificate for its own peer id; the coordinator's peer is in every peer's --peers."""
    from swarmrun.coordinator.owner import public_owner_key
    from swarmrun.node import ensure_identity, peer_id_of, public_key_bytes
    from swarmrun.node.peer.join import read_spec_file

    owner = _Owner()
    agent = _agent(tmp_path / "w1", store=str(tmp_path / "store"))
    agent.client = owner
    await agent._act(_assignment())
    [args] = agent.started
    assert args[0] == "r" and "--task" not in args and "--set" not in args
    spec = read_spec_file(args[args.index("--spec") + 1], "r").spec  # verifies the signature
    assert spec.owner_key == public_owner_key(owner.key) and spec.access == "invite"
    assert spec.task == "synthetic" and spec.hparams["total_steps"] == 9
    mine = peer_id_of(public_key_bytes(ensure_identity(tmp_path / "w1" / "runs" / "r")[1]))
    assert _certified_peer(args) == mine
    other = _agent(tmp_path / "w2")
    other.client, other.bootstrap = owner, ["/ip4/127.0.0.1/tcp/9/p2p/QmCoordinator"]
    await other._act(_assignment(leader="w0"))  # not the leader, no peer yet: waits
    await other._act(_assignment(leader="w0", state="pending"))
    assert other.started == []
    await other._act(_assignment(leader="w0", peers=["/ip4/1.2.3.4/tcp/5/p2p/Qm"]))
    [args] = other.started
    assert args[:4] == ["r", "--peers", "/ip4/1.2.3.4/tcp/5/p2p/Qm", "/ip4/127.0.0.1/tcp/9/p2p/QmCoordinator"]
    assert "--spec" not in args and _certified_peer(args) != mine


async def test_each_assignment_starts_a_new_peer_id(tmp_path):
    """A released peer id is revoked for good: the next assignment of the worker to the run starts another one; a
    restart within one assignment keeps it (its certificate stands)."""
    agent = _agent(tmp_path, store=str(tmp_path / "store"))
    agent.client = _Owner()
    for since in (1.0, 1.0, 2.0):
        await agent._admission(_assignment(since=since)["assignment"], creating=False)
    peers = [_certified_peer(["--invite", str(tmp_path / "runs" / "r" / "invite")])]
    ids = [body["peer_id"] for path, body in agent.client.posts]
    assert ids[0] == ids[1] != ids[2] and peers == ids[2:]


async def test_a_run_with_steps_and_no_snapshot_is_never_restarted_from_its_seed(tmp_path):
    agent = _agent(tmp_path, store=str(tmp_path / "store"), snapshot_wait=0.0)
    for _ in range(3):
        await agent._act(_assignment(step=12))
    assert agent.started == [] and [k for k, _ in agent.events.seen] == ["waiting"]


async def test_a_present_resident_gets_no_peer(tmp_path):
    agent = _agent(tmp_path)
    agent.present = True
    await agent._act(_assignment())
    assert agent.started == []


async def test_a_report_the_coordinator_could_not_take_is_sent_again(tmp_path):
    """A run whose last peer finished while the coordinator was down is reported finished once it is back (the
    churn harness's pool trace found it held its workers for good otherwise)."""
    from swarmrun.protocol.errors import RunNotFound

    class _Down:
        def __init__(self):
            self.up, self.posts = False, []

        def post(self, path, body=None):
            if not self.up:
                raise RunNotFound("coordinator http://127.0.0.1:1 unreachable: [Errno 111] Connection refused")
            self.posts.append((path, body))
            return {"assignment": None}

    agent = _agent(tmp_path)
    agent.client = _Down()
    await agent._report("r", {"step": 19, "loss": 0.5})
    await agent._report("r", {"step": 20})
    await agent._report("r", {"step": 7, "snapshot": {"url": "s@7", "step": 7}})  # an older one: merged under
    agent.client.up = True
    await agent.tick()
    assert agent.client.posts[0] == ("runs/r/progress", {"step": 20, "loss": 0.5, "snapshot": {"url": "s@7", "step": 7}})
    assert agent.unreported == {}

    # an answer cut short (the coordinator killed mid-answer: http.client.IncompleteRead is no OSError) is kept too,
    # and of two snapshots of one step the newer report's wins
    import http.client

    def cut(path, body=None):
        raise http.client.IncompleteRead(b"{")

    agent.client.post = cut
    await agent._report("r", {"step": 30, "snapshot": {"url": "a@30", "step": 30}})
    await agent._report("r", {"step": 30, "snapshot": {"url": "b@30", "step": 30}})
    assert agent.unreported == {"r": {"step": 30, "snapshot": {"url": "b@30", "step": 30}}}


def test_a_restarted_coordinator_does_not_count_its_own_outage_against_the_workers(registry, clock):
    submit(registry, "r")
    worker(registry, "w1")
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)
    clock.advance(600)  # the coordinator was down for ten minutes; the agent's peer trained on
    place_once(registry, Policy(), clock.now, lambda *a, **k: None, up_since=clock.now - 1)
    assert registry.run("r")["workers"] == ["w1"]
    place_once(registry, Policy(), clock.now, lambda *a, **k: None)  # without it, the worker would be lost
    assert registry.run("r")["workers"] == []


def _node(*args, env=None):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMRUN_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "swarmrun.node.cli", *args], env=env, capture_output=True, text=True)


def test_pool_commands_exit_codes(tmp_path):
    assert _node("runs").returncode == 2  # no coordinator given
    assert _node("runs", "--coordinator", "127.0.0.1:9").returncode == 2  # no token
    unreachable = _node("runs", "--json", "--coordinator", "127.0.0.1:9", "--token", "t")
    assert unreachable.returncode == 3 and json.loads(unreachable.stdout.splitlines()[-1])["event"] == "error"
    assert _node("coordinator", "user", "add", "bad name!", "--state-dir", str(tmp_path)).returncode == 2
    assert _node("agent", "--stop-timeout", "40", "--coordinator", "x", "--token", "t").returncode == 2


async def test_a_peer_step_is_reported_with_the_runs_samples_so_far(tmp_path):
    """The dashboard plots loss against samples: the agent reports the cursor's count of samples applied."""
    from swarmrun.coordinator.agent import _Peer

    class _Up:
        def __init__(self):
            self.posts = []

        def post(self, path, body=None):
            self.posts.append((path, body))
            return {}

    agent = _agent(tmp_path)
    agent.client = _Up()
    peer = _Peer(run_id="r", proc=None, started=0.0)
    step = {"event": "step", "step": 4, "loss": 0.25, "samples_per_second": 80.0, "peers": 2,
            "cursor": {"samples_applied": 1024, "blocks_applied": 16}}
    await agent._on_peer_line(peer, json.dumps(step).encode())
    await peer.sending  # sent in the background
    assert agent.client.posts == [("runs/r/progress", {"step": 4, "loss": 0.25, "samples_per_second": 80.0, "peers": 2,
                                                       "samples": 1024,
                                                       "cursor": {"samples_applied": 1024, "blocks_applied": 16}})]
    await agent._on_peer_line(peer, json.dumps({"event": "step", "step": 5}).encode())  # no cursor: no samples
    await agent._flush(peer, now=True)
    assert agent.client.posts[-1] == ("runs/r/progress", {"step": 5})


def test_a_released_certificate_is_revoked_only_after_its_peer_had_time_to_leave():
    """A revoked peer leaves at once (exit 4): revoking at the release would cut its graceful leave, and the last
    peer's snapshot, short. The lists hold every certificate released ``revoke_after`` ago or more."""
    from swarmrun.coordinator.owner import due_revocations

    rows = [dict(run_id="a", peer_id="p1", released_at=100.0), dict(run_id="a", peer_id="p2", released_at=150.0),
            dict(run_id="b", peer_id="p3", released_at=100.0), dict(run_id="b", peer_id="p4", released_at=None)]
    assert due_revocations(120.0, rows, revoke_after=60.0) == {}
    assert due_revocations(160.0, rows, revoke_after=60.0) == {"a": frozenset({"p1"}), "b": frozenset({"p3"})}
    assert due_revocations(210.0, rows, revoke_after=60.0)["a"] == frozenset({"p1", "p2"})
    assert due_revocations(100.0, rows, revoke_after=0.0) == {"a": frozenset({"p1"}), "b": frozenset({"p3"})}


class _FakeDHT:
    """What PoolPeer uses of a hivemind DHT: its address, its owner keys, its stores (kept, by key and subkey)."""

    def __init__(self):
        from types import SimpleNamespace

        self.peer_id = SimpleNamespace(to_base58=lambda: "QmCoordinator")
        self.stored, self.validators, self.alive = [], [], True

    def get_visible_maddrs(self):
        return ["/ip4/127.0.0.1/tcp/9/p2p/QmCoordinator"]

    def add_validators(self, validators):
        self.validators += validators

    def store(self, key, value, *, subkey, expiration_time, return_future):
        self.stored.append((key, subkey, value))
        future = asyncio.get_running_loop().create_future()
        future.set_result(True)
        return future

    def is_alive(self):
        return self.alive


async def test_the_coordinators_peer_publishes_each_runs_revocations_under_its_owner_key(registry, clock):
    """A release becomes a signed revocation list once due, published once per change (and again after a
    restart: the list comes from the registry), under the run owner's signed subkey, verifiable with the owner's
    public key as `node invite revoke`'s."""
    from swarmrun.coordinator.owner import public_owner_key
    from swarmrun.coordinator.peer import PoolPeer
    from swarmrun.node import verify_signature
    from swarmrun.node.net.records import owner_subkey
    from swarmrun.protocol.access import Revocations, revocation_key

    submit(registry, "r")
    worker(registry, "w1")
    registry.assign("w1", "r")
    registry.certify("r", "w1", "QmPeerOfW1xxxxxxxxxxxxxxxx")
    registry.unassign("w1", reason="preempt")
    peer, seen = PoolPeer(_FakeDHT()), _Recorder()
    assert await peer.publish_due(registry, clock.now + 30, 60.0, seen.emit) == 0  # its peer may still be leaving
    assert await peer.publish_due(registry, clock.now + 61, 60.0, seen.emit) == 1
    assert await peer.publish_due(registry, clock.now + 62, 60.0, seen.emit) == 0  # nothing changed
    owner = public_owner_key(registry.owner_key("r"))
    [(key, subkey, value)] = peer.dht.stored
    revocations = Revocations.decode(value)
    assert key == revocation_key("r") and subkey == owner_subkey(owner)
    assert revocations.revoked == {"QmPeerOfW1xxxxxxxxxxxxxxxx"} and revocations.verify(owner, verify_signature)
    assert seen.seen == [("revoked", {"run_id": "r", "peers": ["QmPeerOfW1xxxxxxxxxxxxxxxx"]})]
    assert len(peer.dht.validators) == 1  # the DHT holds the run's owner key, to sign its owner records
    restarted = PoolPeer(_FakeDHT())
    assert await restarted.publish_due(registry, clock.now + 63, 60.0) == 1


async def test_a_coordinator_whose_peer_died_stops():
    """Agents hand every peer the coordinator's peer as bootstrap: the service stops rather than serve a dead one."""
    from swarmrun.coordinator.service import CoordinatorConfig, _revocation_loop
    from swarmrun.protocol.errors import SwarmrunError

    from swarmrun.coordinator.peer import PoolPeer

    dht, stopped = _FakeDHT(), []
    dht.alive = False
    config = CoordinatorConfig(db_url="sqlite://", store="s", state_dir=".")
    with pytest.raises(SwarmrunError):
        await _revocation_loop(None, PoolPeer(dht), config, lambda *a, **k: None, stop=lambda: stopped.append(1))
    assert stopped == [1]


async def test_a_peers_eval_and_its_cursor_summary_reach_the_registry_through_the_api(db_url, tmp_path):
    """The peer's ``eval`` event is reported at once with its own step; its ``step`` event's cursor summary (only the
    keys the schema knows) goes with the step. Through the real API app, on SQLite and PostgreSQL."""
    import asyncio

    from swarmrun.coordinator.agent import _Peer

    registry = Registry(db_url)
    token = registry.add_user("lab")
    registry.submit("lab", Submission(run_id="r", task="synthetic", task_args={}))
    registry.register_worker(Registration(worker_id="w1", hostname="h", resources=CPU), owner="lab")
    registry.assign("w1", "r")
    app = make_app(registry)

    class _Api:
        def __init__(self):
            self.posts = []

        def post(self, path, body=None):
            async def go():
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
                    return await c.post(f"/api/{path}", json=body, headers={"Authorization": f"Bearer {token}"})
            answer = asyncio.run(go())  # the agent posts from a worker thread (asyncio.to_thread)
            assert answer.status_code == 200, answer.text
            self.posts.append((path, body))
            return answer.json()

    agent = _agent(tmp_path)
    agent.client = _Api()
    peer = _Peer(run_id="r", proc=None, started=0.0)
    cursor = {"samples_applied": 640, "blocks_applied": 10, "blocks_pending": 22, "blocks_skipped": 0,
              "blocks_duplicated": 0, "data_epoch": 0, "a_key_of_a_newer_peer": 1}
    await agent._on_peer_line(peer, json.dumps({"event": "eval", "step": 10, "loss": 0.75}).encode())
    await peer.sending
    await agent._on_peer_line(peer, json.dumps({"event": "step", "step": 10, "loss": 0.8, "cursor": cursor}).encode())
    await agent._on_peer_line(peer, json.dumps({"event": "eval", "step": 11, "loss": float("nan")}).encode())  # not sent
    await agent._flush(peer, now=True)
    assert agent.client.posts[0] == ("runs/r/progress", {"step": 10, "eval": {"step": 10, "loss": 0.75}})
    assert [k for k, _ in agent.events.seen].count("peer_eval") == 1 and len(agent.client.posts) == 2
    run = registry.run("r")
    assert (run["eval_step"], run["eval_loss"], run["loss"]) == (10, 0.75, 0.8)
    assert run["accounting"] == {k: v for k, v in cursor.items() if k != "a_key_of_a_newer_peer"}
    registry.close()


async def test_a_joiner_is_reported_to_the_coordinator_only_once_it_holds_the_runs_state(tmp_path):
    """A joiner whose peers all left while it looked for the state holds nothing: reported as the run's peer, it was
    made the run's leader, the others joined it, and the run restarted from step 0 (the pool trace lost 14 steps).
    A leader's peer (creating or resuming) is reported from its start; a joiner once it bootstrapped or stepped."""
    from swarmrun.coordinator.agent import _Peer

    class _Up:
        def __init__(self):
            self.posts = []

        def post(self, path, body=None):
            self.posts.append((path, body))
            return _assignment(peers=["/ip4/1.2.3.4/tcp/6/p2p/QmOther"])  # the same run: the peer trains on

    class _Proc:
        returncode = None

    agent = _agent(tmp_path)
    agent.client = _Up()
    agent.peer = peer = _Peer(run_id="r", proc=_Proc(), started=0.0)  # a joiner (holds_state False)
    await agent._on_peer_line(peer, json.dumps({"event": "listening", "maddrs": ["/ip4/1.2.3.4/tcp/5/p2p/Qm"]}).encode())
    await agent.tick()
    assert "peer" not in agent.client.posts[-1][1]
    await agent._on_peer_line(peer, json.dumps({"event": "bootstrapped", "step": 14}).encode())
    await agent.tick()
    beat = [b for p, b in agent.client.posts if p.endswith("heartbeat")][-1]
    assert beat["peer"] == {"run_id": "r", "maddr": "/ip4/1.2.3.4/tcp/5/p2p/Qm"}
    leader = _Peer(run_id="r", proc=_Proc(), started=0.0, holds_state=True)  # resuming, not listening yet
    agent.peer = leader
    await agent.tick()
    beat = [b for p, b in agent.client.posts if p.endswith("heartbeat")][-1]
    assert beat["peer"] == {"run_id": "r", "maddr": None}


async def test_a_coordinator_that_does_not_answer_never_holds_up_the_peers_events(tmp_path):
    """The agent reads its peer's events one line at a time: one that waited for each report of a fast run (many
    steps and evaluations a second) to a coordinator that did not answer would fill the peer's stdout pipe, and the
    peer, blocked on its next line, would stop training (CI's pool test once saw no step for 240 s after it killed
    the coordinator; this is one way there). Every line is read while a report hangs; what came meanwhile is one
    report, sent once the coordinator answers, with the newest of each kind."""
    import asyncio
    import threading

    from swarmrun.coordinator.agent import _Peer

    class _Hung:
        def __init__(self):
            self.release, self.posts = threading.Event(), []

        def post(self, path, body=None):
            assert self.release.wait(30)  # (a bound: never a hung test)
            self.posts.append((path, body))
            return {}

    agent = _agent(tmp_path)
    agent.client = _Hung()
    peer = _Peer(run_id="r", proc=None, started=0.0)
    for step in range(1, 101):
        await asyncio.wait_for(agent._on_peer_line(peer, json.dumps({"event": "step", "step": step}).encode()), 5)
        if step % 5 == 0:
            line = {"event": "eval", "step": step, "loss": 1.0 / step}
            await asyncio.wait_for(agent._on_peer_line(peer, json.dumps(line).encode()), 5)
    line = {"event": "snapshot", "step": 40, "where": "s@40"}
    await asyncio.wait_for(agent._on_peer_line(peer, json.dumps(line).encode()), 5)
    assert [k for k, _ in agent.events.seen].count("peer_step") == 100 and not agent.client.posts
    agent.client.release.set()
    await peer.sending  # the first report (step 1), in flight all along
    await agent._flush(peer, now=True)
    assert agent.client.posts[0] == ("runs/r/progress", {"step": 1})
    assert agent.client.posts[1:] == [("runs/r/progress", {"step": 100, "eval": {"step": 100, "loss": 0.01},
                                                           "snapshot": {"url": "s@40", "step": 40}})]
