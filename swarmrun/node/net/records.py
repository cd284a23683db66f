"""Every read and write of a run's DHT records (the keys are in ``protocol``): progress reports, providers, the spec,
the owner's records (revocations, pause), the amendment history, pause notes."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Optional, Sequence

from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.swarm import public_key_bytes, run_validators, subkey_owner, unreachable, verify_signature
from swarmrun.node.runtime import await_future
from swarmrun.protocol.access import Revocations, revocation_key
from swarmrun.protocol.codec import unpack
from swarmrun.protocol.errors import AccessRefused, IncompatibleState, ProtocolError, RunNotFound
from swarmrun.protocol.round import ProgressReport, SwarmView, progress_key, spec_key
from swarmrun.protocol.spec import SignedSpec, choose_spec
from swarmrun.protocol.transfer import ProviderRecord, providers_key

logger = logging.getLogger("swarmrun.records")


async def read_subkeys(dht: DHT, key: str, decode, *, signed: bool = False) -> dict:
    """The decoded values of a DHT key's subkeys, by peer id (malformed ones are ignored). ``signed``: only records
    signed by the peer their subkey names (progress reports, votes)."""
    found = await await_future(dht.get(key, latest=True, return_future=True))
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            owner = subkey_owner(subkey)
            if owner is None and not signed and isinstance(subkey, str):
                owner = subkey
            if owner is None:
                continue
            try:
                out[owner] = decode(item.value)
            except (ProtocolError, AttributeError, TypeError):
                continue
    return out


async def read_view(dht: DHT, run_id: str, gate=None) -> SwarmView:
    """The live progress reports of a run, by peer id: signed by that peer and, in an invite-only run, carrying a
    certificate the gate admits (a report from anyone else is not part of the run). ``gate``: the peer's
    ``AccessGate`` (``spec`` and ``check(peer_id, certificate)``), None to read every signed report."""
    reports = await read_subkeys(dht, progress_key(run_id), ProgressReport.decode, signed=True)
    if gate is not None and gate.spec.access != "open":
        reports = {p: r for p, r in reports.items() if gate.check(p, r.certificate) is None}
    return SwarmView(reports=reports)


async def read_providers(dht: DHT, run_id: str, gate=None) -> dict[str, ProviderRecord]:
    """The live provider records of a run, by peer id: only records signed by the peer they name (hivemind's
    validator checked the signature; ``subkey_owner`` that the key is that peer's identity) and, in an invite-only
    run, carrying a certificate the gate admits (as ``read_view``); malformed ones are ignored."""
    found = await await_future(dht.get(providers_key(run_id), latest=True, return_future=True))
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            owner = subkey_owner(subkey)
            if owner is None:
                continue
            try:
                out[owner] = ProviderRecord.decode(item.value)
            except (ProtocolError, AttributeError, TypeError):
                continue
    if gate is not None and gate.spec.access != "open":
        out = {p: r for p, r in out.items() if gate.check(p, r.certificate) is None}
    return out


SPEC_TTL = 120.0
OWNER_STARTUP_TIMEOUT = 15.0  # an owner command's DHT node reaching the given peers
OWNER_SPEC_TIMEOUT = 8.0  # an owner command's read of the run's spec


def anchor_ids(initial_peers: Sequence[str]) -> tuple[str, ...]:
    """The peer ids named by ``--peers`` multiaddrs (``.../p2p/<id>``): the peers a joiner takes the spec from."""
    return tuple(m.rsplit("/p2p/", 1)[1].split("/", 1)[0] for m in initial_peers if "/p2p/" in m)


async def fetch_spec(dht: DHT, run_id: str, *, timeout: float, anchors: Sequence[str] = (),
                     anchored_only: bool = False) -> Optional[SignedSpec]:
    """The run's signed spec, as the peers ``anchors`` (``--peers``) publish it under their signed subkeys
    (``protocol.spec.choose_spec``: one that does not verify is skipped); None if no peer has one within ``timeout``.
    ``anchored_only``: only a spec one of the anchors publishes (whether the run is live *at* the given peers: a
    record a peer that left published lingers in the DHT for its TTL).

    Raises:
        IncompatibleState: only specs that do not verify were found, or conflicting ones (see ``choose_spec``).
    """
    deadline = time.monotonic() + timeout
    while True:
        found = await read_subkeys(dht, spec_key(run_id), _raw_bytes, signed=True)
        if anchored_only:
            found = {signer: data for signer, data in found.items() if signer in anchors}
        signed, skipped = choose_spec(found, run_id=run_id, anchors=anchors, verifier=verify_signature)
        for reason in skipped:
            logger.warning(reason)
        if signed is not None:
            return signed
        if time.monotonic() > deadline:
            if skipped:
                raise IncompatibleState(f"no spec of run {run_id!r} in the swarm verifies: {'; '.join(skipped)}")
            return None
        await asyncio.sleep(0.5)


def _raw_bytes(value) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError("a spec record is bytes")
    return value


async def publish_spec_forever(dht: DHT, signed: SignedSpec, subkey: bytes) -> None:
    """Every peer of a run keeps its signed spec in the DHT under its own signed subkey (``subkey``), so the run
    outlives its creator and a joiner takes the spec from the peers it was given."""
    while True:
        try:
            await await_future(dht.store(spec_key(signed.spec.run_id), signed.encode(), subkey=subkey,
                                         expiration_time=get_dht_time() + SPEC_TTL, return_future=True))
        except Exception as e:
            logger.debug(f"could not publish spec: {e!r}")
        await asyncio.sleep(SPEC_TTL / 4)


@asynccontextmanager
async def owner_session(run_id: str, initial_peers: Sequence[str], key: RSAPrivateKey, *, action: str,
                        listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)):
    """A short-lived DHT node for one of the run owner's commands (revoke, pause); yields ``(dht, signed_spec)``.

    A full node, not a client: what it stores must outlive it, and the peers that read it may leave right after.

    Raises:
        RunNotFound: no peer reachable, or no such run there. AccessRefused: ``key`` is not the run's owner.
    """
    try:
        dht = await asyncio.to_thread(DHT, initial_peers=list(initial_peers), start=True, client_mode=False,
                                      host_maddrs=list(listen), startup_timeout=OWNER_STARTUP_TIMEOUT,
                                      record_validators=run_validators(key, [run_id]))
    except Exception as e:
        logger.debug(f"bootstrap failed: {e!r}")
        raise RunNotFound(unreachable(initial_peers)) from None
    try:
        signed = await fetch_spec(dht, run_id, timeout=OWNER_SPEC_TIMEOUT, anchors=anchor_ids(initial_peers))
        if signed is None:
            raise RunNotFound(f"run {run_id!r} was not found at the given peers")
        if signed.spec.owner_key != public_key_bytes(key):
            raise AccessRefused(f"only the owner of run {run_id!r} may {action}; the key in this --state-dir is not it")
        yield dht, signed
    finally:
        await asyncio.to_thread(dht.shutdown)


REVOCATION_TTL = 365 * 24 * 3600.0


async def read_latest(dht: DHT, key: str):
    return await await_future(dht.get(key, latest=True, return_future=True))


async def store_own(dht: DHT, key: str, value: bytes, subkey: bytes, ttl: float) -> bool:
    """Store ``value`` under the writer's own (signed) ``subkey``; True if at least one node holds it.

    hivemind's ``DHT.store`` answers with the answer of whichever replica finished *last* (``store_many`` in
    hivemind/dht/node.py overwrites ``store_ok`` with each finished store), not "any took it". One refusing replica
    then turns a store the others took into False: a stranger's node keeping a plain value under the key with a later
    expiration refuses every subkey, so a stranger could make ``node revoke`` or ``node pause`` report a failure that
    did not happen. On False, read the key back and look for our value under our subkey.
    """
    if await await_future(dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey,
                                    return_future=True)):
        return True
    found = await read_latest(dht, key)
    if found is None or not isinstance(found.value, dict) or subkey not in found.value:
        return False
    return found.value[subkey].value == value


def owner_subkey(owner_key: bytes) -> bytes:
    """The DHT subkey only the run's owner can write (hivemind's signed records; see swarm.record_validator)."""
    return b"[owner:" + owner_key + b"]"


async def publish_revocations(dht: DHT, revocations: Revocations, owner_key: bytes) -> None:
    if not await store_own(dht, revocation_key(revocations.run_id), revocations.encode(), owner_subkey(owner_key),
                           REVOCATION_TTL):
        raise AccessRefused("the swarm did not accept the revocation list")


HISTORY_TTL = 120.0


NOTE_TTL = 300.0


async def read_history(dht, key: str) -> list[tuple[bytes, ...]]:
    """The amendment histories the run's peers publish, each under its own signed subkey (a malformed one, or one
    under a subkey that is not its peer's, is ignored); the reader verifies them against the spec."""

    def decode(data) -> tuple[bytes, ...]:
        value = unpack(data, max_size=1 << 20)
        if not isinstance(value, list) or not all(isinstance(v, bytes) for v in value):
            raise TypeError("malformed history record")
        return tuple(value)

    return list((await read_subkeys(dht, key, decode, signed=True)).values())


async def store_record(dht, key: str, value: bytes, ttl: float, subkey: Optional[bytes] = None) -> None:
    await await_future(dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True))
