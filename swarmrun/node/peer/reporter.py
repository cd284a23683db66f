"""This peer's word in the DHT and its view of the others': progress reports and provider records, published every
``report_interval`` (longer when steps are long: ``Reporter.interval``), and the swarm's live reports read back (the
view every decision of the trainer reads)."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Callable, Collection, Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node import faults
from swarmrun.node.net.records import read_view
from swarmrun.node.net.swarm import ping_peers
from swarmrun.node.runtime import await_future
from swarmrun.protocol.round import ProgressReport, Role, SwarmView, progress_key
from swarmrun.protocol.spec import Spec
from swarmrun.protocol.transfer import ProviderRecord, providers_key

logger = logging.getLogger("swarmrun.trainer")
REVOCATIONS_EVERY = 5.0  # seconds between two reads of the owner's revocations (invite-only runs)
# how long a trainer that vanished without saying it left still counts in the run's membership (``members``): a
# round must hold a majority of it to advance its history's anchor, so a side of a partition shorter than this
# cannot win the reunion by having stepped alone. Longer than any partition a reunion should resolve, short enough
# that peers killed over a run's life (churn, preemption without a leave) do not keep every round a minority
MEMBERSHIP_MEMORY = 600.0


class Reporter:
    """Publishes what ``report()`` and ``provider_record()`` say, keeps ``view`` fresh, and calls ``on_tick`` after
    each round of both (the trainer's `progress` event).

    Args:
        subkey: this peer's signed subkey (its records carry its identity's signature).
        config: the trainer's config (``report_interval``, ``report_ttl``, ``role``).
    """

    def __init__(self, *, dht: DHT, spec: Spec, gate, config, peer_id: str, subkey: bytes,
                 report: Callable[[], ProgressReport], provider_record: Callable[[], Optional[ProviderRecord]],
                 on_tick: Callable[[], None], step_seconds: Callable[[], Optional[float]] = lambda: None):
        self.dht, self.spec, self.gate, self.config, self.peer_id, self.subkey = dht, spec, gate, config, peer_id, subkey
        self.report, self.provider_record, self.on_tick = report, provider_record, on_tick
        self.step_seconds = step_seconds  # the trainer's mean wall time of a step (None before two commits)
        self.view = SwarmView(reports={})
        self._seen: dict[str, float] = {}  # trainer -> when this peer last saw it live
        self._members: dict[str, float] = {}  # the same, kept MEMBERSHIP_MEMORY unless its last report said it left
        self._waiting_alone = False
        self.newcomer = False  # it joined a run others hold (set by the bootstrap)
        self._first_read: Optional[float] = None  # when this peer first read the run's reports (monotonic)
        self._published = 0.0  # when the progress report was last stored (monotonic)
        self._announced: tuple = ((), 0.0)  # what the last stored provider record said, and when
        self._pinged, self._pinging = 0.0, None  # the last ``reconnect`` (monotonic) and its task

    def interval(self) -> float:
        """Seconds between two rounds of publishing and reading: ``report_interval`` while steps are short, a
        quarter of a step when steps are long (outer mode's take seconds to minutes), at most a quarter of the
        report TTL (a live peer must never look gone). Every report is a signed DHT write that each peer's DHT
        stores and every other peer reads back twice a second: on capped links (``benchmarks/links.py``) that
        control traffic, not the tensors, was most of an outer 8-bit step's bytes. A commit publishes and reads at
        once whatever the interval (``publish_and_read``)."""
        step = self.step_seconds()
        base = self.config.report_interval
        return base if step is None else min(max(base, step / 4), max(base, self.config.report_ttl / 4))

    def _provider_due(self, record: ProviderRecord) -> bool:
        """A provider record changes at a commit (or as transfers start and end): stored when it says something new,
        and often enough that it never expires (each store is a signed DHT write on both sides, and a peer's DHT
        process shares its core with training)."""
        said, at = self._announced
        return _says(record) != said or time.monotonic() - at > self.config.report_ttl / 3

    async def publish(self) -> None:
        """Announce the served state and this peer's progress (a failed store is retried next interval)."""
        expiration = get_dht_time() + self.config.report_ttl
        record = self.provider_record()
        if record is not None and self._provider_due(record):
            try:
                if await await_future(self.dht.store(providers_key(self.spec.run_id), subkey=self.subkey,
                                                     value=record.encode(), expiration_time=expiration,
                                                     return_future=True)):
                    self._announced = (_says(record), time.monotonic())
            except Exception as e:
                logger.debug(f"could not announce the served state: {e!r}")
        try:
            report = self.report().encode()
            await asyncio.sleep(faults.delay_seconds("report"))  # 0 unless a test plans it
            await await_future(self.dht.store(progress_key(self.spec.run_id), subkey=self.subkey,
                                              value=report, expiration_time=expiration, return_future=True))
            self._published = time.monotonic()
        except Exception as e:
            logger.debug(f"could not publish progress: {e!r}")

    async def refresh(self) -> None:
        """Read the live reports (this peer's own from memory: the DHT's copy lags)."""
        view = await read_view(self.dht, self.spec.run_id, self.gate)
        self.view = SwarmView(reports={**view.reports, self.peer_id: self.report()})
        self._first_read = self._first_read or time.monotonic()
        self.recently_live()

    async def publish_and_read(self) -> None:
        """After a commit: publish the new step at once and read the others' (the next step's plan needs a fresh
        view; ``report_interval`` is longer than a step of a fast swarm). Bounded; the periodic round retries."""
        try:
            await asyncio.wait_for(self.publish(), self.config.report_interval)
            await asyncio.wait_for(self.refresh(), self.config.report_interval)
        except Exception as e:
            logger.debug(f"could not refresh the view after a commit: {e!r}")

    async def await_step(self, members: Collection[str], step: int) -> None:
        """Read the reports until every other live peer of ``members`` reports at ``step`` or later (bounded: four
        report intervals of the config). After a commit with work carried into the next step (``outer_overlap``) the
        rest of a part planned on reports of the last step overshot it: each member carried about its part, the
        reports said nothing of it, and one planned and computed a batch more (a step of 280 for 256)."""
        deadline = time.monotonic() + 4 * self.config.report_interval
        while time.monotonic() < deadline:
            behind = [r for p, r in self.view.trainers.items() if p in members and p != self.peer_id and r.step < step]
            if not behind:
                return
            await asyncio.sleep(self.config.report_interval / 4)
            try:
                await asyncio.wait_for(self.refresh(), max(0.0, deadline - time.monotonic()) + 0.1)
            except Exception as e:  # the view stays as it was: the part is planned on it
                logger.debug(f"could not read the reports after a commit: {e!r}")
                return

    def recently_live(self) -> int:
        """Trainers seen live within the report TTL (a high-water mark: a view that is still forming, at a start or
        under load, must not make a minority look like a majority)."""
        now = time.monotonic()
        mine = self.view.reports.get(self.peer_id)
        for peer, r in self.view.trainers.items():
            # an asker waits for a later step: not in the rounds before (counted, it made every group of the others
            # a minority: smoke trace). At the step it asked for it is planned in (``protocol.plan``) and live: not
            # counted there, a creator whose solo steps were shorter than a catch-up committed every step alone and
            # its joiners chased it for the whole run (a 3-peer namespace run, 90 s)
            if r.joining is not None and r.joining > r.step and (mine is None or r.joining != mine.step):
                self._seen.pop(peer, None)
            else:
                self._seen[peer] = now
        self._seen = {p: t for p, t in self._seen.items() if now - t <= self.config.report_ttl}
        for peer, r in self.view.trainers.items():
            if r.left or r.finished:
                self._members.pop(peer, None)  # it said so: its absence is no partition
            else:
                self._members[peer] = now
        return len(self._seen | {self.peer_id: now})

    def watching(self) -> bool:
        """A newcomer that has seen no other trainer yet and has not read the run's reports for a report TTL: its
        first reads may miss the others (a DHT lookup that reached no holder of the key), and a solo commit on such
        a read splits the run (CI: a joiner committed step 1 alone while the others waited for it). Until then
        it neither steps nor counts as alone; a trainer that is live republishes well within the TTL."""
        if not self.newcomer or self.recently_live() > 1:
            return False
        return self._first_read is None or time.monotonic() - self._first_read < self.config.report_ttl

    def alone(self) -> bool:
        """No other trainer was live within the report TTL, and this peer is not a newcomer still ``watching``."""
        return self.recently_live() <= 1 and not self.watching()

    def members(self) -> int:
        """The run's membership as this peer remembers it: trainers live now or lately, and those that vanished
        without saying they left within ``MEMBERSHIP_MEMORY`` (from inside, a crash and a partition look the same),
        itself included. A round holding a majority of it advances its history's anchor (``majority_round``)."""
        now = time.monotonic()
        self._members = {p: t for p, t in self._members.items() if now - t <= MEMBERSHIP_MEMORY}
        return len(self._members.keys() | {self.peer_id})

    def vanished(self, within: float) -> int:
        """Trainers that were live within ``within`` seconds, are not now and did not say they left (it warns once
        per such spell: a peer alone waits for them, ``TrainerConfig.alone_after``)."""
        gone = self._gone(within)
        if gone and not self._waiting_alone:
            logger.warning(f"{len(gone)} trainer(s) vanished without saying they left: not stepping alone for up "
                           f"to {within:.0f}s (a partition looks like a crash from here)")
        self._waiting_alone = bool(gone)
        return len(gone)

    def _gone(self, within: float) -> list[str]:
        now = time.monotonic()
        return sorted(p for p, t in self._members.items()
                      if p != self.peer_id and p not in self.view.trainers and now - t <= within)

    def lost(self) -> list[str]:
        """Trainers of the membership (``members``) not in the view now: vanished without saying they left."""
        return self._gone(MEMBERSHIP_MEMORY)

    async def reconnect(self) -> None:
        """Ping the ``lost`` trainers through this peer's DHT node (``net.swarm.ping_peers``: hivemind forgets a node
        that did not answer and never looks for it again, so the two sides of a healed partition never met)."""
        lost = self.lost()
        try:
            found = await await_future(self.dht.run_coroutine(
                partial(ping_peers, peer_ids=lost, timeout=self.config.report_ttl / 2), return_future=True),
                self.config.report_ttl)
        except Exception as e:
            logger.debug(f"could not ping the trainers that vanished: {e!r}")
            return
        if found:
            logger.info(f"{len(found)} of {len(lost)} trainer(s) that vanished answered again: back in the DHT")

    def _reconnect_due(self) -> None:
        if time.monotonic() - self._pinged < self.config.report_ttl or not self.lost():
            return
        if self._pinging is None or self._pinging.done():
            self._pinged = time.monotonic()
            self._pinging = asyncio.ensure_future(self.reconnect())

    async def hand_to_keepers(self, step: int, within: float) -> bool:
        """A trainer leaving on a stop (a hand-back, a preemption, a signal, its max steps): while a live keeper
        reports an older step than ``step``, keep announcing and serving this peer's state (its caller stops the
        server after), for at most ``within`` seconds. CI's pool trace: both trainers of a run left 0.1 s after a
        step their keeper had not replayed yet, and the next worker joined the keeper three committed steps behind.
        No DHT call when the view shows no such keeper; a keeper whose report is half a TTL old (killed, or its
        DHT stalled) is not waited for; nor is any when this peer's DHT is dead. True: none is behind."""
        deadline = time.monotonic() + within
        if self._keepers_behind(step):
            logger.info(f"serving step {step} while the run's keeper catches up (up to {within:.0f}s)")
        while self._keepers_behind(step):
            left = deadline - time.monotonic()
            if left <= 0 or not self.dht.is_alive():
                return False
            for call in (self.publish, self.refresh):  # apart: a slow store must not keep the view old
                try:
                    await asyncio.wait_for(call(), min(self.config.report_ttl / 4, left))
                except Exception as e:
                    logger.debug(f"while handing the state to the run's keepers: {e!r}")
            await asyncio.sleep(max(0.0, min(self.config.report_interval, deadline - time.monotonic())))
        return True

    def _keepers_behind(self, step: int) -> bool:
        fresh = get_dht_time() - self.config.report_ttl / 2
        return any(p != self.peer_id and r.role == Role.KEEPER and not r.left and r.step < step and r.time >= fresh
                   for p, r in self.view.reports.items())

    async def serve_laggards(self, stop_requested: asyncio.Event) -> None:
        """Once finished, keep serving the final state (and reporting `finished`) while live trainers are still
        behind, bounded by ``finish_linger``. A peer that was waiting in a round when the others committed the
        last step learns it only when its round times out; without this it finds no provider and no `finished`
        report left (both expire with their TTL), and waits for peers forever."""
        deadline = time.monotonic() + self.config.finish_linger
        while time.monotonic() < deadline and not stop_requested.is_set():
            if not any(p != self.peer_id and not r.finished for p, r in self.view.trainers.items()):
                return
            await asyncio.sleep(self.config.report_interval)

    async def forever(self) -> None:
        try:
            await self._forever()
        finally:
            if self._pinging is not None:
                self._pinging.cancel()

    async def _forever(self) -> None:
        last_revocations = 0.0
        while True:
            interval, started = self.interval(), time.monotonic()
            if time.monotonic() - self._published >= interval / 2:
                await self.publish()  # not again right after a commit's publish_and_read
            try:
                await self.refresh()
                self._reconnect_due()
                if self.spec.access != "open" and time.monotonic() - last_revocations > REVOCATIONS_EVERY:
                    await self.gate.refresh(self.dht)  # the owner's revocations
                    last_revocations = time.monotonic()
            except Exception as e:
                logger.debug(f"could not read progress: {e!r}")
            if self.config.role == Role.TRAINER:
                self.on_tick()
            # a longer interval counts the turn's DHT calls in (a live peer's reports stay well inside the TTL); the
            # shortest one sleeps all of it after them, as it always has
            await asyncio.sleep(max(self.config.report_interval, interval - (time.monotonic() - started)))


def _says(record: ProviderRecord) -> tuple:
    """What a provider record tells a joiner (its time aside)."""
    return record.manifest_hash, record.serving, tuple(sorted(record.log.items())), record.anchor
