"""The state a peer serves: the frozen copy of its current step and the step record of its last commit, the chunk
server that serves them to joiners and the fetcher that downloads from other providers, over one replicated p2pd.

The frozen copy is made after every commit and every catch-up (the trainer needs it anyway: the snapshot writer
and the served state share it), so serving never holds the training loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.fetch import Fetcher
from swarmrun.node.net.serve import StateServer, admit_open
from swarmrun.node.output import set_log_context
from swarmrun.node.state.run import FrozenState, RunState
from swarmrun.protocol.history import Ledger
from swarmrun.protocol.round import Role
from swarmrun.protocol.spec import Spec
from swarmrun.protocol.transfer import ProviderRecord

STOP_TIMEOUT = 3.0  # p2pd may be gone on the way out: stopping the server never hangs longer


class ServedState:
    """What this peer serves, and the client it fetches with.

    Args:
        state: the run state (the trainer's; mutated in place by steps and catch-ups).
        chunk_size: the spec's chunk size. chunk_timeout: a provider silent this long is dropped by a fetch.
    """

    def __init__(self, *, state: RunState, spec: Spec, dht: DHT, gate, chunk_size: int, chunk_timeout: float):
        self.state, self.spec, self.dht, self.gate = state, spec, dht, gate
        self.chunk_size, self.chunk_timeout = chunk_size, chunk_timeout
        self.frozen: Optional[FrozenState] = None
        self.state_hash = ""
        # (step, state_hash) of the frozen state, replaced as one object: a step is applied in the worker thread,
        # and a report read in between from state.step and state_hash paired the new step with the old hash (the
        # links benchmark saw the others count those reports as a majority at the step disagreeing with theirs, and
        # re-sync or leave a forming round for nothing)
        # (step, state_hash, anchor): the pair and the history's anchor (``ProgressReport.anchor``) replaced as one
        # object too: a report pairing a new step with the anchor of the one before would look outranked
        self.position: tuple[int, str, Optional[tuple[int, str]]] = (-1, "", None)
        # the anchor the next refresh gives the state, set before a step is applied or a state adopted: "here" (the
        # step itself, committed by a majority round), a tuple (a replayed record's, a fetched provider's), "unknown"
        # (a fetched state whose provider named none); None keeps the anchor
        self.next_anchor: object = None
        self.ledger = Ledger()  # this peer's own history since it adopted its lineage (``should_resync``'s evidence)
        self._lock = threading.Lock()  # position is replaced by the worker thread (refresh) and the loop (anchors)
        self.record: Optional[FrozenState] = None  # the step record of the last commit, not yet published
        self.server: Optional[StateServer] = None
        self.fetcher: Optional[Fetcher] = None
        self.refresh()

    def refresh(self, adopted: bool = False) -> None:
        """Freeze the state of the current step (runs in the worker thread; published from the loop).
        ``adopted``: the state was fetched (a new lineage: this peer's own history starts again there)."""
        self.frozen = self.state.freeze(chunk_size=self.chunk_size)
        self.state_hash = self.frozen.manifest.state_hash()
        self.manifest_hash = self.frozen.manifest.manifest_hash()  # named by every provider record until the next
        with self._lock:
            anchor, self.next_anchor = self.next_anchor, None
            if anchor is None:
                anchor = self.position[2]
            elif anchor == "here":
                anchor = (self.frozen.step, self.state_hash)
            elif anchor == "unknown":
                anchor = None
            self.position = (self.frozen.step, self.state_hash, anchor)
            if adopted or self.position[0] <= self.ledger.newest:
                self.ledger.reset(self.frozen.step, self.state_hash)
            else:
                self.ledger.add(self.frozen.step, self.state_hash)
        set_log_context(step=self.state.step)

    @property
    def anchor(self) -> Optional[tuple[int, str]]:
        return self.position[2]

    def anchor_here(self) -> None:
        """This peer's state starts the run's history here (a created or resumed run): it is its own anchor."""
        with self._lock:
            step, state_hash, _ = self.position
            self.position = (step, state_hash, (step, state_hash))

    def hold_anchor(self, anchor: tuple[int, str]) -> None:
        """This peer's own history went through ``anchor`` (its ledger holds that state at that step), a newer
        majority commit than the anchor it carries (a state fetched from a provider whose record lagged): take it."""
        with self._lock:
            step, state_hash, mine = self.position
            if (mine is None or mine < anchor) and anchor[0] <= step and self.ledger.holds(anchor):
                self.position = (step, state_hash, anchor)

    async def start(self) -> None:
        """Serve this peer's state and step records over its p2pd, and fetch through it (idempotent)."""
        if self.server is not None:
            return
        p2p = await self.dht.replicate_p2p()
        self.server = StateServer(p2p, self.spec.run_id, admit_open(self.spec.spec_hash(), self.gate))
        await self.server.start()
        self.server.publish_state(self.frozen)
        self.fetcher = Fetcher(p2p, self.spec.run_id, self.spec.spec_hash(), chunk_timeout=self.chunk_timeout,
                               credentials=self.gate.credentials)

    def publish(self) -> None:
        """Serve the current frozen state, and the last commit's step record if there is one."""
        if self.server is not None:
            self.server.publish_state(self.frozen)
            if self.record is not None:
                self.server.publish_record(self.record)
        self.record = None

    def drop_records(self) -> None:
        """The records served so far describe another history of this peer (a fetched state, a diverged replay)."""
        if self.server is not None:
            self.server.drop_records()

    def provider_record(self, role: Role) -> Optional[ProviderRecord]:
        """What this peer announces it serves (None before it serves)."""
        if self.server is None or self.frozen is None:
            return None
        self.server.announce(self.manifest_hash)  # what a record names stays served a while
        return ProviderRecord(step=self.state.step, manifest_hash=self.manifest_hash,
                              state_hash=self.state_hash, total_bytes=self.frozen.manifest.total_bytes,
                              time=get_dht_time(), keeper=role == Role.KEEPER,
                              serving=self.server.sessions, log=self.server.announced_log(),
                              certificate=self.gate.credentials or b"", anchor=self.position[2])

    async def stop(self) -> None:
        if self.server is not None and self.dht.is_alive():
            try:
                await asyncio.wait_for(self.server.stop(), STOP_TIMEOUT)
            except asyncio.TimeoutError:
                pass
