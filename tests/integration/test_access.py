"""An invite-only run against strangers and a hostile client that talks to the swarm through the library."""

import asyncio
import json
import signal
import time

import pytest
import torch
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.peer.access import certificate_text
from swarmrun.node.peer.averaging import RoundAverager
from swarmrun.node.net.swarm import ensure_identity, record_validator, signed_subkey
from swarmrun.node.net.records import read_view
from swarmrun.node.net.fetch import Fetcher, FetchFailed
from swarmrun.protocol.access import Certificate
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.round import ProgressReport, Role, RoundMeta, progress_key
from swarmrun.protocol.transfer import choose_state
from tests.swarm_helpers import Swarm, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s
RUN = "guarded"


def _last(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _peer_id(state_dir):
    return _last(run_cli("identity", "show", "--state-dir", str(state_dir), "--json"))["peer_id"]


async def _hostile_client(maddr: str, state_dir, spec_hash: str) -> dict:
    """A client that ignores the access policy: fetches state, enters a round, injects progress."""
    _, key = ensure_identity(state_dir)
    dht = DHT(initial_peers=[maddr], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              identity_path=str(state_dir / "identity.key"), record_validators=[record_validator(key)])
    me = dht.peer_id.to_base58()
    out = {"peer_id": me}
    try:
        p2p = await dht.replicate_p2p()
        from swarmrun.node.net.records import read_providers

        records = await read_providers(dht, RUN)
        choice = choose_state(records)
        assert choice is not None, "the run's providers are announced (signed)"
        # 1. fetch the state with no certificate, then with one it signed itself
        forged = Certificate.issue(run_id=RUN, peer_id=me, now=time.time(), ttl=3600, signer=key.sign).encode()
        for credentials in (None, forged):
            try:
                await Fetcher(p2p, RUN, spec_hash, chunk_timeout=5, credentials=credentials).fetch(
                    choice.manifest_hash, choice.providers, deadline=time.monotonic() + 15)
                out.setdefault("fetched", []).append(credentials is not None)
            except FetchFailed as e:
                out.setdefault("refused", []).append(str(e))
        # 2. inject progress: its own signed report saying the run finished, and one under another peer's id
        fake = ProgressReport(step=10**6, samples=0, samples_per_second=1e9, role=Role.TRAINER, state_hash="f" * 64,
                              time=get_dht_time(), finished=True, certificate=forged)
        for subkey in (signed_subkey(record_validator(key), me), choice.providers[0]):
            dht.store(progress_key(RUN), fake.encode(), expiration_time=get_dht_time() + 60, subkey=subkey)
        # 3. enter averaging rounds at the swarm's step
        averager = RoundAverager([torch.zeros(16)], dht, spec_hash=spec_hash, prefix=f"swarmrun_{RUN}", start=True,
                                 min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=2.0,
                                 allreduce_timeout=5.0, target_group_size=None, min_group_size=2)
        try:
            for _ in range(4):
                view = await read_view(dht, RUN)
                step = max((r.step for p, r in view.reports.items() if r.step < 10**6), default=0)
                cursor = DataCursor.new(seed=0, num_examples=4096, block_size=8)
                averager.prepare_round(step, cursor)
                meta = RoundMeta(spec_hash=spec_hash, step=step, samples=8, blocks=RangeSet.from_items([1]),
                                 data_epoch=0, grad_norm=0.0, certificate=forged)
                try:
                    outcome = await averager.step(gather=meta.encode(), weight=1.0, timeout=6, wait=False,
                                                  allow_retries=False)
                    out.setdefault("rounds", []).append(outcome.complete)
                except Exception as e:
                    out.setdefault("round_errors", []).append(type(e).__name__)
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()
    return out


def test_invite_only_run_refuses_strangers_and_a_hostile_client(tmp_path):
    with Swarm(tmp_path, RUN) as swarm:
        created = swarm.create("p0", "--task", "synthetic", "--set", "total_steps=100000", "--access", "invite",
                               "--matchmaking-time", "1.0", "--min-peers", "2")
        spec_hash = swarm.wait_for("p0", "listening", timeout=10)["spec_hash"]
        assert created
        # a stranger: exit 4 with the reason and what to ask for
        stranger = run_cli("join", RUN, "--peers", swarm.maddr, "--state-dir", str(tmp_path / "stranger"), "--json")
        assert stranger.returncode == 4, stranger.stdout[-2000:]
        assert "invite-only" in _last(stranger)["message"] and "node invite" in _last(stranger)["message"]
        # an expired certificate
        # (issued by the owner's key an hour ago, for one second: the clock is the certificate's, not the test's)
        owner_key = ensure_identity(tmp_path / "p0")[1]
        expired = Certificate.issue(run_id=RUN, peer_id=_peer_id(tmp_path / "late"), now=time.time() - 3600, ttl=1,
                                    signer=owner_key.sign)
        (tmp_path / "late.invite").write_text(certificate_text(expired) + "\n")
        late = run_cli("join", RUN, "--peers", swarm.maddr, "--state-dir", str(tmp_path / "late"),
                       "--invite", str(tmp_path / "late.invite"), "--json")
        assert late.returncode == 4 and "expired" in _last(late)["message"]
        # a certificate signed by someone who is not the owner
        p1_id = _peer_id(tmp_path / "p1")
        refused = run_cli("invite", RUN, "--peer", p1_id, "--state-dir", str(tmp_path / "stranger"),
                          "--out", str(tmp_path / "forged.invite"), "--json")
        assert refused.returncode == 4 and "not the owner" in _last(refused)["message"]  # `node invite` says so
        # a certificate signed by a stranger's key anyway (not by `node invite`): every peer refuses it
        stranger_key = ensure_identity(tmp_path / "stranger")[1]
        forged_cert = Certificate.issue(run_id=RUN, peer_id=p1_id, now=time.time(), ttl=3600, signer=stranger_key.sign)
        (tmp_path / "forged.invite").write_text(certificate_text(forged_cert) + "\n")
        forged = run_cli("join", RUN, "--peers", swarm.maddr, "--state-dir", str(tmp_path / "p1"),
                         "--invite", str(tmp_path / "forged.invite"), "--json")
        assert forged.returncode == 4 and "not signed by the run's owner" in _last(forged)["message"]
        # the invited peer trains
        assert run_cli("invite", RUN, "--peer", p1_id, "--state-dir", str(tmp_path / "p0"),
                       "--out", str(tmp_path / "p1.invite")).returncode == 0
        swarm.join("p1", "--matchmaking-time", "1.0", "--invite", str(tmp_path / "p1.invite"))
        swarm.wait_for("p1", "bootstrapped", timeout=120)
        swarm.wait_for("p1", "step", timeout=120)
        # the hostile client
        hostile = asyncio.run(_hostile_client(swarm.maddr, tmp_path / "hostile", spec_hash))
        assert "fetched" not in hostile and len(hostile["refused"]) == 2, hostile
        assert not any(hostile.get("rounds", [])), hostile  # never in a complete round
        logs = (tmp_path / "p0.log").read_text() + (tmp_path / "p1.log").read_text()
        assert f"refused peer {hostile['peer_id']}" in logs  # refused by the admission gate, logged
        assert logs.count(f"refused peer {hostile['peer_id']}") <= 8  # once per process and path, not spammed
        # its "finished" reports were not taken: the run goes on and its view holds only p0 and p1
        step = swarm.events("p0", "step")[-1]["step"]
        swarm.wait_for("p0", "step", timeout=60, step=step + 2)
        status = _last(run_cli("status", RUN, "--peers", swarm.maddr, "--json"))
        assert len(status["peers"]) == 2 and not status["finished"], status
        # the owner revokes p1: it leaves with exit 4
        revoke = run_cli("invite", "revoke", RUN, "--peer", p1_id, "--state-dir", str(tmp_path / "p0"),
                         "--peers", swarm.maddr, "--json")
        assert revoke.returncode == 0, revoke.stdout[-2000:] + revoke.stderr[-2000:]
        assert swarm.wait_exit("p1", timeout=90) == 4
        assert "revoked" in swarm.events("p1", "error")[-1]["message"]
        swarm.peers["p0"].kill_group(signal.SIGTERM)
        assert swarm.wait_exit("p0", timeout=60) == 0
