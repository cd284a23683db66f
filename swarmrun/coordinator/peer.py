"""The coordinator's own DHT peer: the bootstrap point of every pool run (agents put its multiaddrs in their peers'
``--peers``, so the pool's runs and the coordinator share one DHT), and the writer of the runs' owner records: each
run's revocation list, signed with the run's owner key, under the owner's signed subkey, as `node invite revoke`
publishes it.

Its identity is kept in the coordinator's state dir (``STATE_DIR/peer``), so its peer id, and with a fixed
``--listen`` port its multiaddrs, survive a restart. The revocation lists themselves are derived from the registry
on every pass (``owner.due_revocations``): a coordinator killed before it published one publishes it once it is
back, and republishes each list every ``REPUBLISH`` seconds (the peers holding replicas come and go).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from swarmrun.coordinator.owner import due_revocations
from swarmrun.coordinator.registry import Registry
from swarmrun.protocol.access import revoke

__all__ = ["PoolPeer", "REPUBLISH"]

logger = logging.getLogger("swarmrun.coordinator")
REPUBLISH = 300.0


class PoolPeer:
    """A running DHT peer of the coordinator (``start``), which publishes the runs' revocations (``publish_due``)."""

    def __init__(self, dht) -> None:
        self.dht = dht
        self.maddrs = tuple(str(m) for m in dht.get_visible_maddrs())
        self.peer_id = dht.peer_id.to_base58()
        self._keys: dict[str, bytes] = {}  # run id -> its owner's public key, for runs whose key the DHT holds
        self._published: dict[str, tuple[frozenset[str], float]] = {}  # run id -> (revoked peers, when)

    @classmethod
    def start(cls, state_dir: Path, *, listen: Sequence[str], announce: Sequence[str] = ()) -> "PoolPeer":
        """Start the peer (blocking: a DHT and its p2pd). Raises UsageError (a busy port, an identity in use)."""
        from swarmrun.node import SwarmConfig, start_dht

        config = SwarmConfig(state_dir=state_dir, listen=tuple(listen), announce=tuple(announce))
        dht, _ = start_dht(config)
        return cls(dht)

    def shutdown(self) -> None:
        self.dht.shutdown()

    async def publish_due(self, registry: Registry, now: float, revoke_after: float,
                          emit: Callable[..., None] = lambda *a, **k: None) -> int:
        """Publish every run's revocation list that changed (or is due to be republished); returns how many."""
        from swarmrun.node import publish_revocations

        due = due_revocations(now, await asyncio.to_thread(registry.released_certificates), revoke_after)
        done = 0
        for run_id, peers in sorted(due.items()):
            published, at = self._published.get(run_id, (frozenset(), -REPUBLISH))
            if published == peers and now - at < REPUBLISH:
                continue
            key = await asyncio.to_thread(self._hold, registry, run_id)
            revocations = revoke(None, run_id=run_id, peers=peers, now=time.time(), signer=key.sign)
            await publish_revocations(self.dht, revocations, self._keys[run_id])
            self._published[run_id] = (peers, now)
            done += 1
            if published != peers:
                logger.info(f"revoked {len(peers)} peer(s) of run {run_id}")
                emit("revoked", run_id=run_id, peers=sorted(peers))
        return done

    def alive(self) -> bool:
        """Whether the DHT's process still runs (agents hand its multiaddrs to every peer they start)."""
        return self.dht.is_alive()

    def _hold(self, registry: Registry, run_id: str):
        """The run's owner key, held by the DHT's process to sign the run's owner records.

        The run's records are not watched here (``watch_runs``): one run's schema validator pickles to about 16 KB,
        which hivemind sends its DHT process in two writes, and the process's pipe reader, made non-blocking by
        uvloop, can read the first alone, fail, and die on the rest. Every reader of a run's records validates
        them (``net.validator``), so a record a stranger stores on this node is refused where it would count.
        """
        from swarmrun.node import hold_owner_keys, load_key, public_key_bytes

        key = load_key(registry.owner_key(run_id))
        if run_id not in self._keys:
            self._keys[run_id] = public_key_bytes(key)
            hold_owner_keys(self.dht, [key])  # about 2 KB: one write
        return key
