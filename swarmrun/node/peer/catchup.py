"""Catch-up: how a trainer (or keeper) reaches the swarm's newest step.

It replays announced step records from its own state when they reach back to it, else fetches the best-provided
recent state from many providers at once (``net.fetch.Fetcher``) and replays the records since. An object handed
what it works on (the run state, the served state, the reporter's view, a replay function), not a part of the
trainer: it is the one part of a peer that moves state between peers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from hivemind import DHT

from swarmrun.node.net.records import read_providers
from swarmrun.node.net.fetch import FetchFailed
from swarmrun.node.output import Events
from swarmrun.node.peer.reporter import Reporter
from swarmrun.node.peer.served import ServedState
from swarmrun.node.state.run import FrozenState, RunState
from swarmrun.node.state.steps import read_step_record, record_anchor
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.errors import CatchUpFailed, IncompatibleState, Stopped, SwarmrunError
from swarmrun.protocol.manifest import Manifest
from swarmrun.protocol.history import best_anchor, outranked, preferred_hash, should_resync, trusted_view
from swarmrun.protocol.round import SwarmView
from swarmrun.protocol.spec import Spec
from swarmrun.protocol.transfer import Choice, ProviderRecord, choose_state, log_sources

RECORD_FETCH_TIMEOUT = 30.0  # one step record (a gradient's size) from its providers
#: a peer left out of a round asks to be planned this many steps past the swarm's newest, twice as many per miss in
#: a row (the others must read its ask before they plan that step: a report's way may take many steps), at most
#: ``MAX_JOIN_AHEAD``
JOIN_AHEAD, MAX_JOIN_AHEAD = 2, 64
JOIN_MISSES_FORGOTTEN = 60.0  # seconds after which a new miss counts as the first again
MAX_JOIN_MISSES = 10  # asks in a row the swarm went past: then it races for rounds again (and gives up after a while)

logger = logging.getLogger("swarmrun.trainer")


class CatchUp:
    """Reaches the swarm's newest step for one peer.

    Args:
        state: the peer's run state (a fetched state is applied to it in place).
        served: what the peer serves (refreshed after a replay or a fetch) and its fetcher.
        reporter: the peer's view of the swarm (refreshed while catching up).
        replay: applies one step record's gradients and blocks to ``state`` (the trainer's optimizer step: a
            replay must run the same code as a commit to give the committers' bits).
        record_bytes: the size of one step record (a gradient), to choose between replaying and fetching.
    """

    def __init__(self, *, dht: DHT, spec: Spec, config, events: Events, peer_id: str, state: RunState,
                 served: ServedState, reporter: Reporter, stop_requested: asyncio.Event,
                 replay: Callable[[list, RangeSet], Awaitable[None]], record_bytes: int):
        self.dht, self.spec, self.config, self.events, self.peer_id = dht, spec, config, events, peer_id
        self.state, self.served, self.reporter, self.stop_requested = state, served, reporter, stop_requested
        self.replay, self.record_bytes = replay, record_bytes
        self.diverged: Optional[Manifest] = None  # a replay that did not give the committers' state (diagnosis)
        # the step this peer asked to be planned in (``ProgressReport.joining``), until when it waits for it, and
        # how many times in a row it was left out
        self.joining: Optional[int] = None
        self._join_until, self._missed_at, self.misses = 0.0, 0.0, 0
        self._newest: tuple[int, float] = (-1, 0.0)  # the swarm's newest step as this peer last saw it move, and when
        self._forked = False  # in this catch-up, a step record of the swarm's started from another state at our step
        self._fork_checked: Optional[tuple[int, str]] = None  # the state ``_check_fork`` last read a record for

    def behind(self) -> bool:
        best = best_anchor(self.reporter.view)  # its own report counts once: two reports must carry an anchor
        if best is not None:
            self.served.hold_anchor(best)  # an anchor that lagged behind this peer's own history catches up
        step, state_hash, anchor = self.served.position  # one object (a step may be being applied in the worker thread)
        return should_resync(self.reporter.view, me=self.peer_id, step=step, state_hash=state_hash, anchor=anchor,
                             ledger=self.served.ledger)

    def _trusted(self) -> tuple[SwarmView, Callable[[ProviderRecord], bool]]:
        """The view of the peers this one may follow, and a test of provider records alike: not those of a
        history outranked by the newest majority commit in view (a split's minority, ``should_resync``). This peer's
        own anchor counts as one report: alone it excludes no one (a 1-1 reunion would wait forever on both sides)."""
        best = best_anchor(self.reporter.view)
        return trusted_view(self.reporter.view, best=best), lambda r: not outranked(r.step, r.anchor, best)

    def finished_elsewhere(self) -> bool:
        """A trainer reports the run finished, on a history not outranked (a split's minority that reached the end
        alone does not end the majority's run)."""
        return self._trusted()[0].finished()

    def left_out(self) -> Optional[int]:
        """The others committed this peer's step before its round found them: their plan was made before they read
        this peer's report (a swarm whose steps are shorter than a report's way through the DHT). Ask to be planned
        a few steps ahead (``joining``, in this peer's reports) and wait there instead of racing every step.

        Returns:
            the step asked for (None after ``MAX_JOIN_MISSES``).
        """
        now = time.monotonic()
        self.misses = self.misses + 1 if now - self._missed_at < JOIN_MISSES_FORGOTTEN else 1
        self._missed_at, self.joining = now, None
        if self.misses > MAX_JOIN_MISSES:
            return None
        ahead = min(JOIN_AHEAD << (self.misses - 1), MAX_JOIN_AHEAD)
        self.joining = max(self.state.step, self.reporter.view.newest_step) + ahead
        self._join_until = now + self.config.state_timeout
        return self.joining

    def trained(self) -> None:
        """This peer committed a step (in a round with the others, or alone): the next time it is left out counts as
        the first. The count of asks in a row (each twice as far ahead) was kept across it: a peer that had asked
        during its join and re-synced after a partition healed asked 16 steps past the swarm's newest, a pair stepping
        every 1.5-4 s, and chased it for the rest of the run (the 3-peer split trace, 1 run in 6)."""
        self.misses = 0

    def waiting(self) -> bool:
        """Whether this peer waits for the step it asked to be planned in. It stops waiting there, when no other
        trainer is live, when it holds the swarm's newest step and that has not moved for a report TTL, or after
        ``state_timeout``. Caught up past it, it was left out again (the others read the ask too late, or gave up
        waiting for its part): it asks further ahead."""
        if self.joining is not None and self.state.step > self.joining and time.monotonic() < self._join_until:
            logger.info(f"the swarm went past step {self.joining} without this peer; asking for step "
                        f"{self.left_out()}")
        now, newest = time.monotonic(), self.reporter.view.newest_step
        if newest != self._newest[0]:
            self._newest = (newest, now)
        # a swarm that stopped stepping while this peer holds its newest step is no fast swarm: it may be waiting for
        # this peer (CI's smoke trace: the asker's partner left, the last trainer would not step alone, and it gave
        # up after 50 rounds in 17 s while the asker waited for a step only they together could take)
        stalled = self.state.step >= newest and now - self._newest[1] > self.config.report_ttl
        if self.joining is not None and (
                self.state.step >= self.joining or now > self._join_until or stalled
                or not any(p != self.peer_id for p in self.reporter.view.trainers)):
            self.joining = None
        return self.joining is not None

    async def catch_up(self, *, deadline: float) -> dict:
        """Reach the swarm's newest step: replay step records from this state when they reach back to it, else
        fetch the best-provided recent state from many providers at once and replay the records since.

        Returns:
            what it took: bytes fetched, state fetches, steps replayed, providers used.
        Raises:
            IncompatibleState: nothing verified could be had before ``deadline``.
        """
        await self.served.start()
        how = dict(bytes=0, fetched=0, replayed=0, providers=0, banned=0, discarded=0)
        self._forked = False  # a step record of the swarm's history started from another state at this peer's step
        last_error, corrupt = "no provider announced a state", False
        while time.monotonic() < deadline:
            if self.stop_requested.is_set():
                raise Stopped()
            if not self.dht.is_alive():
                raise SwarmrunError("hivemind's DHT process died; leaving")
            await self.reporter.refresh()
            trusted, trust = self._trusted()
            records = {p: r for p, r in (await read_providers(self.dht, self.spec.run_id, self.served.gate)).items()
                       if p != self.peer_id and p not in self.served.fetcher.banned}  # a liar's state is not chosen
            # not a history outranked by the newest majority commit; all of them if none is left (an anchor can lag)
            records = {p: r for p, r in records.items() if trust(r)} or records
            if not records and not any(p != self.peer_id for p in trusted.reports):
                last_error = "no peer of the run answered"  # a DHT read can miss under load: ask again
                await asyncio.sleep(self.config.report_interval)
                continue
            newest = max([r.step for r in records.values()] + [trusted.newest_step])
            if self.state.step >= newest and not self.behind():
                how["banned"] = len(self.served.fetcher.banned)  # providers this peer caught lying so far
                self.served.fetcher.partials.clear()  # caught up: an unfinished download is of a step behind this one
                return how
            choice = choose_state(records, trusted_hashes=self._trusted_hashes())
            # replay while the records to fetch weigh less than a whole state (Adam: about 3 records); after one
            # state fetch always replay: a swarm that steps during every fetch must not send us round again
            fetch_first = how["fetched"] == 0 and choice is not None and choice.step > self.state.step and \
                (newest - self.state.step) * self.record_bytes > records[choice.providers[0]].total_bytes
            if not fetch_first and await self._replay(records, newest, deadline, how):
                continue
            if choice is None or (choice.step, choice.state_hash) == (self.state.step, self.served.state_hash) or \
                    (choice.step < self.state.step and not self.behind()):
                await asyncio.sleep(self.config.report_interval)  # nothing better to fetch yet
                continue
            if choice.step > self.state.step:
                await self._check_fork(records, deadline)
            try:
                frozen = await self._fetch_state(choice, deadline, how)
            except FetchFailed as e:  # unavailable (gone, replaced, unreachable) or lying providers: try again
                last_error, corrupt = str(e), False
                await asyncio.sleep(self.config.report_interval)
                continue
            except IncompatibleState as e:
                last_error, corrupt = str(e), True
                await asyncio.sleep(self.config.report_interval)
                continue
            await self._adopt(frozen, records[choice.providers[0]], how)
        error = IncompatibleState if corrupt else CatchUpFailed  # exit 5 only for a state that did not verify
        raise error(f"could not catch up with the swarm within {self.config.state_timeout:.0f}s: {last_error}")

    async def _adopt(self, frozen: FrozenState, provider: ProviderRecord, how: dict) -> None:
        """Make a fetched state this peer's, with its history's anchor (from its provider's record)."""
        if self.diverged is not None and self.diverged.step == frozen.step:
            logger.warning(f"the replayed state of step {frozen.step} differed from the fetched one in: "
                           f"{', '.join(manifest_differences(self.diverged, frozen.manifest)) or 'nothing?'}")
        self.diverged = None
        # the fetched state's anchor is another state than this peer held at that step: a history it leaves
        self._forked = self._forked or (provider.anchor is not None and self.served.ledger.holds(provider.anchor) is False)
        how["discarded"] += self._discarded(frozen.step)
        self._forked = False  # the adopted state is the swarm's history: a later fetch discards none of it
        self.served.next_anchor = provider.anchor or "unknown"  # a provider of an earlier build names none
        await asyncio.to_thread(self.state.apply_frozen, frozen, adopt=True)  # a fetched state is ours alone
        await asyncio.to_thread(self.served.refresh, True)
        self.served.drop_records()  # earlier records described another history of this peer
        self.served.publish()

    async def _fetch_state(self, choice: Choice, deadline: float, how: dict) -> FrozenState:
        total = {"done": 0, "t0": time.monotonic(), "last": 0.0}

        def progress(new_bytes: int, total_bytes: int, active: int) -> None:
            total["done"] += new_bytes
            now = time.monotonic()
            if now - total["last"] >= 0.5 or total["done"] >= total_bytes:
                total["last"] = now
                self.events.emit("transfer_progress", step=choice.step, bytes=total["done"], total_bytes=total_bytes,
                                 mb_per_s=round(total["done"] / max(now - total["t0"], 1e-6) / 2**20, 1),
                                 providers=active)

        frozen, stats = await self.served.fetcher.fetch(choice.manifest_hash, choice.providers, deadline=deadline,
                                                 progress=progress)
        # the fetch verified every chunk and tensor digest against the manifest; its state_hash is checked here
        if frozen.manifest.state_hash() != choice.state_hash:
            raise IncompatibleState(f"state of step {choice.step} does not verify: state_hash")
        how["bytes"] += stats.bytes
        how["fetched"] += 1
        how["providers"] = max(how["providers"], sum(1 for b in stats.by_provider.values() if b > 0))
        logger.info(f"fetched state of step {choice.step}: {stats.bytes / 2**20:.1f} MiB in {stats.seconds:.2f}s from "
                    f"{how['providers']} provider(s)" + (f", resumed {stats.resumed_chunks} chunks" if stats.resumed_chunks else ""))
        return frozen

    async def _check_fork(self, records: dict, deadline: float) -> None:
        """Before a state ahead replaces steps this peer committed outside a majority (its anchor is older than its
        step: a split's minority that stepped alone, or a lone survivor), read the swarm's step record from this
        peer's step: one that starts from another state is the evidence that those steps are discarded, and counted
        (``_discarded``). A split's minority behind the majority otherwise re-synced with ``discarded`` 0 (a 3-peer
        namespace run: 22 solo steps gone, none reported). No such record announced (the swarm went further than
        the records its providers keep): no evidence, none counted."""
        step, state_hash, anchor = self.served.position
        if self._forked or anchor is None or anchor[0] >= step or self._fork_checked == (step, state_hash):
            return
        manifest_hash, sources = log_sources(records, step)
        if manifest_hash is None:
            return
        self._fork_checked = (step, state_hash)  # once per state: an unanswered fetch does not hold every retry
        try:
            record, _ = await self.served.fetcher.fetch(manifest_hash, sources,
                                                        deadline=min(deadline, time.monotonic() + RECORD_FETCH_TIMEOUT))
            self._forked = read_step_record(record)[2] != state_hash
        except IncompatibleState as e:
            logger.info(f"step record {step} unavailable: {e}")

    async def _replay(self, records: dict, newest: int, deadline: float, how: dict) -> bool:
        """Replay announced step records from this peer's step towards ``newest``; True if any was replayed."""
        replayed = 0
        while self.state.step < newest and time.monotonic() < deadline:
            manifest_hash, sources = log_sources(records, self.state.step)
            if manifest_hash is None:
                break
            try:
                record, stats = await self.served.fetcher.fetch(manifest_hash, sources,
                                                         deadline=min(deadline, time.monotonic() + RECORD_FETCH_TIMEOUT))
                grads, applied, before, after = read_step_record(record)
            except IncompatibleState as e:
                logger.info(f"step record {self.state.step} unavailable: {e}")
                break
            if before != self.served.state_hash:
                self._forked = True  # the swarm's history went through another state at this step
                break  # this peer's state is not the one the record starts from: a whole state is needed
            self.served.next_anchor = record_anchor(record)  # the anchor after the step (None: keep this one's)
            await self.replay(grads, applied)  # on the trainer's step thread
            if self.served.state_hash != after:
                # e.g. another device's arithmetic: the replay does not give the committers' bits
                logger.warning(f"replaying step {self.state.step - 1} did not give the committers' state; fetching one")
                self.diverged = self.served.frozen.manifest
                self.served.drop_records()
                await asyncio.to_thread(self.served.refresh)
                return False
            self.served.record = record
            self.served.publish()  # this peer serves the state and the record it replayed, too
            how["bytes"] += stats.bytes
            replayed += 1
        how["replayed"] += replayed
        return replayed > 0

    def _trusted_hashes(self) -> dict[int, str]:
        view = self._trusted()[0]
        steps = {r.step for p, r in view.trainers.items() if p != self.peer_id}
        return {step: h for step in steps if (h := preferred_hash(view, step=step, me=self.peer_id))}

    def _discarded(self, fetched_step: int) -> int:
        """Steps of this peer's history a fetched state of ``fetched_step`` replaces (a split's minority re-syncing
        to the majority's history, or a fork healed at its step), at most: those since its last majority commit
        (its anchor), which the swarm's history may share. 0 when the fetched state is ahead on this history."""
        step, _, anchor = self.served.position
        if step == 0 or (fetched_step > step and not self._forked):
            return 0
        base = anchor[0] if anchor is not None and anchor[0] < step else min(fetched_step, step - 1)
        lost = max(0, step - base)
        if lost:
            logger.warning(f"leaving this peer's history at step {step} for the swarm's at step {fetched_step}: "
                           f"at most {lost} step(s) committed here since its last majority commit are discarded")
        return lost


def manifest_differences(a: Manifest, b: Manifest) -> list[str]:
    """Where two manifests' training content differs: tensor names, content keys (a diagnosis for logs)."""
    out = [f"{x.name}" for x, y in zip(a.tensors, b.tensors) if x.digest != y.digest or x.name != y.name]
    out += [f"content.{k}" for k in sorted(set(a.content) | set(b.content)) if a.content.get(k) != b.content.get(k)]
    if a.spec_hash != b.spec_hash:
        out.append("spec_hash")
    return out
