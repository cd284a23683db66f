"""A stranger against a run's DHT records, on loopback: real hivemind DHT nodes, the attacker a separate node with
its own identity and no swarmrun validator (issue 14).

The attack: a plain value with an expiration ten years out under the run's spec key and providers key (hivemind's
storage lets a plain value with a later expiration replace whatever is there, and bounds no expiration). Without
the run-record validator it hides the run from every joiner; with it, neither the victim's storage (store path)
nor a reader that joins afterwards (find path: the stranger's node answers with its value) takes it.
"""

from __future__ import annotations

import subprocess

import psutil
import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.records import SPEC_TTL
from swarmrun.node.net.swarm import (
    SwarmConfig,
    public_key_bytes,
    record_validator,
    signed_subkey,
    start_dht,
    verify_signature,
)
from swarmrun.protocol.round import spec_key
from swarmrun.protocol.spec import SignedSpec, Spec
from swarmrun.protocol.transfer import ProviderRecord, providers_key

pytestmark = pytest.mark.integration

RUN = "sec-run"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEN_YEARS = 10 * 365 * 86400.0
PLANTED = b"\x00" * 8


def _pgrep_p2pd() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def _our_p2pd() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.name() == "p2pd"]


def _run_records(dht: DHT, key) -> tuple[SignedSpec, ProviderRecord]:
    """Publish the run's spec (signed by ``key``) and this peer's provider record (its signed subkey)."""
    spec = Spec(run_id=RUN, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                num_examples=1024, owner_key=public_key_bytes(key),
                hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 8})
    signed = SignedSpec.sign(spec, key.sign)
    provider = ProviderRecord(step=3, manifest_hash="a" * 64, state_hash="b" * 64, total_bytes=10, time=get_dht_time())
    subkey = signed_subkey(record_validator(key), dht.peer_id.to_base58())
    assert dht.store(spec_key(RUN), signed.encode(), expiration_time=get_dht_time() + SPEC_TTL, subkey=subkey)
    assert dht.store(providers_key(RUN), provider.encode(), expiration_time=get_dht_time() + 60, subkey=subkey)
    return signed, provider


def _reads_the_run(dht: DHT, signed: SignedSpec, provider: ProviderRecord) -> None:
    found = dht.get(spec_key(RUN), latest=True)
    assert found is not None and isinstance(found.value, dict), "the stranger's value replaced the run's spec"
    [item] = found.value.values()  # each peer publishes the spec under its signed subkey
    got = SignedSpec.decode(item.value)
    assert got == signed and got.verify(verify_signature) is None
    assert found.expiration_time < get_dht_time() + 2 * SPEC_TTL
    found = dht.get(providers_key(RUN), latest=True)
    assert found is not None and isinstance(found.value, dict), "the stranger's value replaced the providers"
    assert [ProviderRecord.decode(item.value) for item in found.value.values()] == [provider]


@pytest.mark.timeout(240)
def test_a_strangers_far_plain_values_do_not_replace_the_runs_spec_and_providers(tmp_path):
    before = _pgrep_p2pd()
    dhts: list[DHT] = []
    ours: list[psutil.Process] = []
    try:
        # the victim, a peer of the run, its DHT started as `node join` starts it (the run's validator installed).
        # (Adding it to a running DHT, `watch_runs`, went through hivemind's add_validators, which hung once in a
        # full-suite run; no production path adds validators later.)
        victim, key = start_dht(SwarmConfig(state_dir=tmp_path / "victim", listen=tuple(LOOPBACK)), run_ids=(RUN,))
        dhts.append(victim)
        maddrs = tuple(str(m) for m in victim.get_visible_maddrs())
        signed, provider = _run_records(victim, key)

        attacker = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=list(maddrs))  # own identity, no validator
        dhts.append(attacker)
        for k in (spec_key(RUN), providers_key(RUN)):
            attacker.store(k, PLANTED, expiration_time=get_dht_time() + TEN_YEARS)
            held = attacker.get(k, latest=True)  # the stranger's node holds its value, and serves it
            assert held is not None and held.value == PLANTED
            assert held.expiration_time > get_dht_time() + 9 * 365 * 86400

        _reads_the_run(victim, signed, provider)  # store path: the victim refused the stranger's records

        # a joiner's DHT, started after the attack: the attacker pushes and answers with its value (find path)
        reader, _ = start_dht(SwarmConfig(state_dir=tmp_path / "reader", initial_peers=maddrs,
                                          listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(reader)
        _reads_the_run(reader, signed, provider)

        # control: a joiner's DHT with hivemind's signature validator only (swarmrun before this validator)
        control = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=list(maddrs),
                      record_validators=[record_validator(None)])
        dhts.append(control)
        hidden = control.get(spec_key(RUN), latest=True)
        assert hidden is not None and hidden.value == PLANTED, "the attack works without the run-record validator"
        ours = _our_p2pd()
        assert len(ours) == len(dhts)
    finally:
        for dht in dhts:
            dht.shutdown()
    _, alive = psutil.wait_procs(ours, timeout=15)
    assert not alive, f"p2pd left running: {[p.pid for p in alive]}"
    assert not {p.pid for p in ours} & _pgrep_p2pd()
    print(f"p2pd before: {sorted(before)}, after: {sorted(_pgrep_p2pd())}")


@pytest.mark.timeout(180)
def test_a_strangers_far_plain_value_under_any_key_of_the_run_reaches_no_reader(tmp_path):
    """The same attack on every key of the schema table (progress, revocations, pause, pause notes, votes,
    history, matchmaking...): a reader whose DHT runs the validator never gets the stranger's plain value, on the
    store path (the victim) nor on the find path (a joiner started afterwards)."""
    from swarmrun.protocol.records import RUN_KEYS

    keys = [schema.keys(RUN)[0] for schema in RUN_KEYS.values()]
    dhts: list[DHT] = []
    try:
        victim, _ = start_dht(SwarmConfig(state_dir=tmp_path / "victim", listen=tuple(LOOPBACK)), run_ids=(RUN,))
        dhts.append(victim)
        maddrs = tuple(str(m) for m in victim.get_visible_maddrs())
        attacker = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=list(maddrs))  # own identity, no validator
        dhts.append(attacker)
        for k in keys:
            attacker.store(k, PLANTED, expiration_time=get_dht_time() + TEN_YEARS)
            assert attacker.get(k, latest=True).value == PLANTED
        reader, _ = start_dht(SwarmConfig(state_dir=tmp_path / "reader", initial_peers=maddrs,
                                          listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(reader)
        for dht in (victim, reader):
            for k in keys:
                found = dht.get(k, latest=True)
                assert found is None or found.value != PLANTED, f"{k}: the stranger's plain value was read"
    finally:
        for dht in dhts:
            dht.shutdown()
