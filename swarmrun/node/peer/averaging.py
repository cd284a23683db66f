"""The collective round on hivemind's all-reduce: exact averaging, failure reports, admission.

hivemind's ``DecentralizedAverager`` as shipped gives peers different bits (reducers return
``avg - x`` that receivers add), lets a failed reducer's part silently stay local and drops a failed
sender only from the parts not yet reduced. ``RoundAverager`` is the one narrow subclass that turns
its all-reduce into the round of DESIGN.md; ``ExactAllReduceRunner`` is the runner it uses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.compression import NoCompression, deserialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aenumerate, amap_in_executor, azip, as_aiter, enter_asynchronously
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.bounds import install_protobuf_bounds
from swarmrun.node.net.pipes import whole_messages
from swarmrun.protocol.codec import unpack
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.errors import ProtocolError, SwarmrunError
from swarmrun.node import faults
from swarmrun.node.peer import codecs
from swarmrun.node.peer.feedback import ErrorFeedback, ResidualParts
from swarmrun.protocol.records import group_bits
from swarmrun.protocol.round import (ClaimDecision, RoundMeta, check_round_meta, decide_claims, decode_gathered,
                                     step_bounds)
from swarmrun.protocol.spec import DEFAULT_STEP_TOLERANCE

logger = get_logger(__name__)
SUSPECT_STEPS = 10  # rounds a sender caught with bad gradients is refused in
NORM_HISTORY = 32  # declared norms of complete rounds kept to judge a new one
LOCK_POLL_SECONDS = 0.5  # the host checks that the averager process lives this often while waiting for its lock
NORM_RANGE = 20.0  # a declared norm this many times the recent median is refused at admission
MATCHMAKING_WEDGED_S = 60.0  # a matchmaking lock held at every round start for this long is taken as lost


class AveragerGone(SwarmrunError):
    """hivemind's averager process is gone (killed, crashed): this peer can take part in no further round."""


@dataclass(frozen=True)
class RoundOutcome:
    """What the averager process reports to the trainer after one all-reduce (picklable, small)."""

    group_id: bytes
    peer_ids: tuple[str, ...]  # participants, in group order
    metas: tuple[RoundMeta, ...]
    weights: tuple[float, ...]
    complete: bool  # every part came back averaged from every reducer, no sender was banned
    reason: str = ""
    sent_bytes: int = 0  # tensor messages this peer sent in the all-reduce (its parts, its averaged parts), encoded
    formed_at: float = 0.0  # DHT time the group was formed (matchmaking over), as this peer saw it
    allreduce_s: float = 0.0  # from the group's forming to this outcome (admission checks and the all-reduce)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose receivers copy the reducer's averaged part instead of adding a delta.

    Overrides (all for exactness, see DESIGN.md "Commit semantics"):
    - ``__init__``: the part container returns averaged parts (``return_deltas=False``); the weight of
      each sender comes from the round's claim decision, not from the number in its messages.
    - ``_communicate_with_peer`` (own part) and ``_accumulate_parts_streaming`` (others' parts): every
      contribution is averaged as the bits its sender's message decodes to (this peer's own part too, passed
      once through the run's codec), and each averaged part is encoded once, with the run's codec (not the one a
      sender's message names), into one message that every receiver gets and the reducer itself decodes: with any
      codec, every participant holds the bits of the same bytes.
    - ``_generate_input_for_peer``: counts the encoded bytes of this peer's parts as they go (``sent_bytes``, with the
      averaged parts it sends back as a reducer): what the codec saves, measured on the messages themselves; with
      ``residuals`` (error feedback, ``feedback.py``) it writes what each part's encoding lost, as this peer's own
      part in ``_communicate_with_peer`` does.
    """

    def __init__(self, *, sender_weights: Sequence[float], tensors: Sequence[torch.Tensor],
                 round_step: Optional[int] = None, declared_norms: Sequence[float] = (),
                 residuals: Optional[Sequence[torch.Tensor]] = None, **kwargs):
        super().__init__(tensors=tensors, **kwargs)
        self.round_step = round_step
        self.declared_norms = tuple(declared_norms)
        self.bad_senders: list[str] = []
        self.sender_weights = tuple(sender_weights)
        container_kwargs = {k: kwargs[k] for k in ("compression", "part_size_bytes", "tensor_infos") if k in kwargs}
        self.tensor_part_container = TensorPartContainer(
            tensors, self.peer_fractions, return_deltas=False, **container_kwargs
        )
        self.compression = self.tensor_part_container.compression
        own_index = self.ordered_peer_ids.index(self.peer_id)
        # the infos of the parts this peer reduces: hivemind keeps them only beside the parts (a private deque). The
        # partition is the same on every peer, so they describe every sender's part of the same index too
        self.part_infos = tuple(info for _, info in self.tensor_part_container._input_parts_by_peer[own_index])
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(own_index)
        self._averaged_messages: dict[int, asyncio.Future] = {}  # part index -> its one encoded averaged part
        self.sent_bytes = 0
        self.residual_parts = ResidualParts(residuals, self.peer_fractions, **container_kwargs) if residuals else None
        self.weight = self.sender_weights[self.sender_peer_ids.index(self.peer_id)] if self.peer_id in self.sender_peer_ids else 0.0

    def _plausible(self, sender_index: int, part_index: int, wire: tuple, part: Optional[torch.Tensor]) -> bool:
        """A slice of a sender's gradient is in the run's codec, of its part's shape, finite and no larger than the
        whole gradient's declared norm (the weight of a sender is its claimed samples, never a number it declares;
        its norm bounds what it sends, with the codec's rounding as slack)."""
        if part is None or part_index >= len(self.part_infos):
            return False
        info = self.part_infos[part_index]
        if wire != codecs.wire_format(self.compression, info) or part.shape != self.parts_for_local_averaging[part_index].shape:
            return False
        if not bool(torch.isfinite(part).all()):
            return False
        if sender_index < len(self.declared_norms):
            declared = self.declared_norms[sender_index]
            slack = 1 + 1e-3 + codecs.rounding_bound(self.compression, info)
            return declared >= 0 and float(part.float().norm()) <= declared * slack + 1e-6
        return True

    def _as_sent(self, part: torch.Tensor, part_index: int) -> torch.Tensor:
        """The bits this peer's own part decodes to, as its message to another reducer would."""
        if type(self.compression) is NoCompression:  # fp32 as is: decoding gives back the same bits
            return part
        return deserialize_torch_tensor(self.compression.compress(part, self.part_infos[part_index]))

    def _averaged_message(self, part_index: int, averaged: torch.Tensor) -> asyncio.Future:
        """The averaged part as every receiver gets it: encoded once, by the run's codec; every stream of this
        reducer sends these bytes and the reducer's own copy is decoded from them."""
        if part_index not in self._averaged_messages:
            loop = asyncio.get_event_loop()
            self._averaged_messages[part_index] = loop.run_in_executor(
                None, self.compression.compress, averaged, self.part_infos[part_index])
        return self._averaged_messages[part_index]

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            sent = await loop.run_in_executor(None, self._as_sent, tensor_part, part_index)
            if self.residual_parts is not None:
                self.residual_parts.record(peer_index, part_index, tensor_part, sent)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, sent, weight=self.weight)
            message = await self._averaged_message(part_index, averaged)
            as_received = await loop.run_in_executor(None, deserialize_torch_tensor, message)
            self.tensor_part_container.register_processed_part(peer_index, part_index, as_received)
            faults.fire("allreduce", self.round_step)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        raw = self.tensor_part_container._input_parts_by_peer[peer_index]  # intact until its average comes back
        async for part_index, message in aenumerate(super()._generate_input_for_peer(peer_index)):
            self.sent_bytes += message.ByteSize()
            if self.residual_parts is not None:
                self.residual_parts.record_message(peer_index, part_index, raw[part_index][0], message.tensor_part)
            yield message
            # a planned kill also fires once a part was sent: a peer that reduces no part of its own (hivemind gives
            # a small tensor to fewer reducers, in a random order) must die mid all-reduce too (CI saw one survive)
            faults.fire("allreduce", self.round_step)

    @staticmethod
    def _decode(message: averaging_pb2.AveragingData) -> tuple[tuple, Optional[torch.Tensor]]:
        part = message.tensor_part
        try:
            return (part.compression, part.dtype), deserialize_torch_tensor(part)
        except Exception:  # a format this build cannot decode (BLOCKWISE_8BIT without bitsandbytes, a bad buffer)
            return (part.compression, part.dtype), None

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        part_index = 0
        weight = self.sender_weights[sender_index]
        try:
            async for wire, tensor_part in amap_in_executor(
                self._decode, stream, max_prefetch=self.tensor_part_container.prefetch
            ):
                if not self._plausible(sender_index, part_index, wire, tensor_part):
                    self.bad_senders.append(self.sender_peer_ids[sender_index].to_base58())
                    break  # the finally bans the sender: its parts are not averaged, the round is incomplete
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break
                message = await self._averaged_message(part_index - 1, averaged_part)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=message)
                self.sent_bytes += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class RoundAverager(DecentralizedAverager):
    """hivemind's averager, narrowed to swarmrun's round.

    Overrides, each because hivemind has no hook for it:
    - ``_set_round_context`` (new, reached through hivemind's control pipe by ``prepare_round``): the
      round's step and cursor; the group key carries the step, so only peers at one step meet.
    - ``rpc_join_group``: admission of a follower (spec hash, step, its certificate in an invite-only run)
      before it enters the group, i.e. before any tensor moves.
    - ``_aggregate_with_group``: checks every member's metadata again (a follower checks the leader's
      group), decides claims and weights, runs ``ExactAllReduceRunner`` and returns a ``RoundOutcome``
      instead of raising on a partial all-reduce (a retry would run on half-averaged tensors).
    - ``_run_allreduce_inplace_``: copies the averaged parts into the tensors.
    - ``get_tensors``: in the host process, waits for the averaged tensors' lock only while the averager process
      lives. An averager process killed in the middle of a round (a signal to the whole process group, the OOM
      killer) dies holding that lock, and hivemind's blocking ``with lock`` then froze the host's event loop for
      good: no leave, no last report, no leave snapshot, until something SIGKILLed it.
    - ``__del__``: hivemind's reads ``_parent_pid``, which its ``__init__`` sets late; an averager whose
      construction failed earlier (a refused argument) printed an AttributeError at garbage collection.
    - ``run`` (the averager process's entry): bounds the declared length of every averager message before hivemind
      buffers it (``net.bounds.install_protobuf_bounds``; hivemind reads it in a static method of ``P2P``), and
      decodes hivemind's 8-bit formats under numpy 2 (``codecs.install_codecs``), and reads its control pipe in
      whole messages (``net.pipes``: under uvloop a long one was torn and the averager process died).
    """

    def run(self):
        install_protobuf_bounds()  # in the averager's process, before its handlers are registered
        codecs.install_codecs()
        self._inner_pipe = whole_messages(self._inner_pipe)  # uvloop tears long control messages (net/pipes.py)
        super().run()

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        spec_hash: str,
        gate=None,
        feedback: Optional[ErrorFeedback] = None,
        **kwargs,
    ):
        self.spec_hash, self.feedback = spec_hash, feedback  # error feedback: the host's carry, the shared residuals
        self._residuals = feedback.residuals if feedback is not None else None
        self.gate = gate  # copied into the averager process at its start; revocations follow through prepare_round
        self._suspects: dict[str, int] = {}  # senders caught with bad gradient slices -> step until which refused
        self._recent_norms: collections.deque = collections.deque(maxlen=NORM_HISTORY)  # of complete rounds
        self._round_step: Optional[int] = None
        self._round_cursor: Optional[DataCursor] = None
        self._round_bounds: tuple = (None, DEFAULT_STEP_TOLERANCE)  # the step's size bounds (prepare_round)
        self._round_live = 0  # trainers the host saw live (prepare_round)
        self._matchmaking_held_since: Optional[float] = None  # see _watch_matchmaking
        self._matchmaking_held: set = set()  # the locks seen held at every round start since then
        super().__init__(averaged_tensors, dht, **kwargs)

    def __del__(self):
        if "_parent_pid" in self.__dict__:
            super().__del__()

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """hivemind's ``get_tensors``; in the host process it raises ``AveragerGone`` instead of waiting forever
        on a lock whose holder died."""
        lock = self.lock_averaged_tensors
        if os.getpid() == self.__dict__.get("_parent_pid", os.getpid()) and self._started():
            while not lock.acquire(timeout=LOCK_POLL_SECONDS):
                if not self.is_alive():
                    raise AveragerGone("hivemind's averager process died holding the averaged tensors' lock")
        else:  # the averager process itself (hivemind's all-reduce), or an averager not started yet
            lock.acquire()
        try:
            yield self._averaged_tensors
        finally:
            lock.release()

    def _started(self) -> bool:
        return self._popen is not None

    # ---- runs in the averager process ---------------------------------------------------------------
    def prepare_round(self, step: int, cursor: DataCursor, revocations=None, *, target: Optional[int] = None,
                      tolerance: float = DEFAULT_STEP_TOLERANCE, group_size: Optional[int] = None,
                      live: int = 0) -> None:
        """Tell the averager process which step the next round is for and the cursor its claims are
        decided against. hivemind's control pipe is the only channel into that process; its messages are
        handled in order, so this arrives before the ``step()`` call that follows it. The pipe dispatches by method
        name: that is hivemind's protocol for it (``DecentralizedAverager._run_internal``), not one of ours; this
        is its only use, and the name is this class's own method.

        ``target``/``tolerance``: the step's size bounds (the claim decision keeps the step within them);
        ``group_size``: the members of the step plan; a group assembles the moment it holds them all. ``live``: the
        trainers this peer saw live; a group that cannot be a majority of them does not start its all-reduce."""
        encoded = revocations.encode() if revocations is not None else None
        self._outer_pipe.send(("_set_round_context", [step, cursor.to_dict(), encoded],
                               dict(target=target, tolerance=tolerance, group_size=group_size, live=live)))

    async def _set_round_context(self, step: int, cursor: dict, revocations: Optional[bytes] = None, *,
                                 target: Optional[int] = None, tolerance: float = DEFAULT_STEP_TOLERANCE,
                                 group_size: Optional[int] = None, live: int = 0) -> None:
        if self._round_step is None:
            from swarmrun.node.net.streams import quiet_dropped_streams

            quiet_dropped_streams(asyncio.get_running_loop())  # this process's loop too
        self._watch_matchmaking(time.monotonic())
        self._round_step = step
        self._round_cursor = DataCursor.from_dict(cursor)
        self._round_bounds = (target, tolerance)
        self._round_live = live
        # hivemind's leader assembles its group as soon as it holds target_group_size members (matchmaking.py,
        # rpc_join_group): the plan's member count, so a round starts when its last member joins, not at the end
        # of matchmaking_time. Set per round: the run's live trainers change
        self._matchmaking.target_group_size = group_size if group_size and group_size >= 2 else None
        # and never assembles (it disbands and looks on, as hivemind does below min_group_size) a group that is not a
        # majority of the live trainers: decide_commit would abandon it after its members paid the all-reduce
        self._matchmaking.min_group_size = max(2, live // 2 + 1)
        if revocations is not None and self.gate is not None:
            from swarmrun.protocol.access import Revocations

            self.gate.revocations = Revocations.decode(revocations)  # verified by the host process
        # peers at different steps rarely meet: the group key carries the step mod 256 as its group bits (a finite
        # set of keys, each in the run's schema table: protocol.records); admission refuses one at another step.
        # The key's prefix must stay, hivemind derives the state-download key from it
        self._matchmaking.group_key_manager.group_bits = group_bits(step)

    def _watch_matchmaking(self, now: float) -> None:
        """Replace hivemind's ``Matchmaking`` when one of its locks is lost.

        hivemind's leader handler (``Matchmaking.rpc_join_group``) yields while it holds ``lock_request_join_group``;
        a follower that hangs up mid-handler leaves the generator to the loop's finaliser, and an abandoned search can
        outlive its cancellation holding ``lock_looking_for_group``. A peer with such a lock looks for groups and is
        never joined (or never looks); with two such peers of four, no group is a majority again. Seen once at
        links.py's full size: one all-reduce did not finish, hivemind logged "aclose(): asynchronous generator is
        already running", and all four peers stayed idle at step 3, "could not find a group", for 5 minutes.

        A round starts when this peer's previous round is over, so a lock held at the start of every round for
        ``MATCHMAKING_WEDGED_S`` is taken as lost: the matchmaking's state is logged and a fresh ``Matchmaking`` takes
        its place (hivemind's handlers look it up per call, DecentralizedAverager.rpc_join_group; the caller sets
        this round's group bits and sizes on it next). A narrow hook: hivemind has no recovery of its own.

        A search for a step that is over (cancelled: the swarm moved on) is replaced at once: until it winds down it
        leads groups with that step's metadata under the key of the next (the group bits are set on its key manager),
        and a member that joined it found a member of another step and looked on; a late joiner's first round at its
        new step stalled the whole swarm for an averaging timeout (tests/integration/test_late_joiner.py)."""
        mm = self._matchmaking
        if mm.step_control is not None and mm.step_control.done():
            logger.info("hivemind's search for a cancelled round is still winding down: starting a fresh matchmaking")
            self._fresh_matchmaking()
            return
        held = {name for name in ("lock_request_join_group", "lock_looking_for_group") if getattr(mm, name).locked()}
        if self._matchmaking_held_since is not None:
            held &= self._matchmaking_held  # the same lock at every round start, not one and then the other
        if not held:
            self._matchmaking_held_since = None
            return
        self._matchmaking_held = held
        if self._matchmaking_held_since is None:
            self._matchmaking_held_since = now
            return
        if now - self._matchmaking_held_since < MATCHMAKING_WEDGED_S:
            return
        logger.warning(f"hivemind's matchmaking lost its {' and '.join(sorted(held))} (held at every round start for "
                       f"{now - self._matchmaking_held_since:.0f}s; followers {len(mm.current_followers)}, leader "
                       f"{mm.current_leader}, group assembled {mm.assembled_group.done()}): starting a fresh one")
        self._fresh_matchmaking()

    def _fresh_matchmaking(self) -> None:
        self._matchmaking = Matchmaking(self._p2p, self.schema_hash, self.dht, client_mode=self.client_mode,
                                        **self.matchmaking_kwargs)
        self._matchmaking_held_since = None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        rejection = None
        try:
            meta = decode_gathered(request.gather)
            if self._round_step is None:
                rejection = "not in a round"
            else:
                rejection = self._admission(context.remote_id.to_base58(), meta)
        except ProtocolError as e:
            rejection = f"malformed metadata: {e}"
        if rejection is not None:
            logger.debug(f"refused {context.remote_id} at admission: {rejection}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def _admission(self, peer: str, meta: RoundMeta) -> Optional[str]:
        """Who may be in this round (before any tensor moves): the run's spec and step, access (certificate for
        this very peer id, which libp2p authenticated), and not a sender caught with bad gradients lately."""
        found = check_round_meta(meta, spec_hash=self.spec_hash, step=self._round_step)
        if found is not None:
            return str(found)
        if self.gate is not None:
            refused = self.gate.check(peer, meta.certificate)
            if refused is not None:
                return f"access: {refused}"
        if self._suspects.get(peer, -1) >= (self._round_step or 0):
            return "sent gradients that did not match its declared norm in a recent round"
        if len(self._recent_norms) >= NORM_HISTORY // 2:
            typical = statistics.median(self._recent_norms)
            if typical > 0 and meta.grad_norm > NORM_RANGE * typical:
                return f"declared gradient norm {meta.grad_norm:.3g} is far above the swarm's recent {typical:.3g}"
        return None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        formed, t0 = get_dht_time(), time.perf_counter()
        outcome = await self._aggregate(group_info, min_vector_size, **kwargs)
        return replace(outcome, formed_at=formed, allreduce_s=time.perf_counter() - t0)

    async def _aggregate(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> RoundOutcome:
        peer_ids = tuple(p.to_base58() for p in group_info.peer_ids)
        try:
            metas = tuple(decode_gathered(blob) for blob in group_info.gathered)
        except ProtocolError as e:
            raise_matchmaking(f"malformed metadata in group: {e}")
        for peer, meta in zip(peer_ids, metas):
            found = self._admission(peer, meta)
            if found is not None:
                raise_matchmaking(f"group member {peer[-6:]} refused: {found}")
        modes = tuple(AveragingMode(unpack(blob)[1]) for blob in group_info.gathered)
        if len(peer_ids) < self._round_live // 2 + 1:  # decide_commit would abandon it: known before tensors move
            return RoundOutcome(group_info.group_id, peer_ids, metas, (), False,
                                f"group of {len(peer_ids)} is not a majority of {self._round_live} live trainers")
        target, tolerance = self._round_bounds
        claims: ClaimDecision = decide_claims(metas, self._round_cursor, target=target, tolerance=tolerance)
        sender_weights = [w for w, mode in zip(claims.weights, modes) if mode != AveragingMode.AUX]
        if sum(sender_weights) <= 0:
            return RoundOutcome(group_info.group_id, peer_ids, metas, claims.weights, False, "no accepted samples")
        if target is not None and claims.samples < step_bounds(target, tolerance)[0]:  # known before any tensor moves
            return RoundOutcome(group_info.group_id, peer_ids, metas, claims.weights, False,
                                f"round carries {claims.samples} samples, fewer than the step's {target}")
        fractions = tuple(0.0 if m == AveragingMode.CLIENT else 1.0 for m in modes)
        kwargs.pop("weight", None)
        try:
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                declared = [m.grad_norm for m, mode in zip(metas, modes) if mode != AveragingMode.AUX]
                runner = await self._run_exact_allreduce(local_tensors, group_info, fractions, sender_weights,
                                                         declared_norms=declared, **kwargs)
        except Exception as e:  # a failed peer, a timeout, a protocol error: the round is incomplete
            logger.debug(f"all-reduce failed: {e!r}", exc_info=True)
            sent = self._last_runner.sent_bytes if getattr(self, "_last_runner", None) is not None else 0
            self._note_bad_senders()
            return RoundOutcome(group_info.group_id, peer_ids, metas, claims.weights, False, f"all-reduce failed: {e!r}",
                                sent)
        failed = runner.tensor_part_container.failed_size
        self._note_bad_senders()
        banned = sorted(p.to_base58()[-6:] for p in runner.banned_senders)
        if failed or banned:
            reason = f"{failed} values not averaged by their reducer; banned senders {banned}"
            return RoundOutcome(group_info.group_id, peer_ids, metas, claims.weights, False, reason, runner.sent_bytes)
        self._recent_norms.extend(m.grad_norm for m in metas if m.grad_norm > 0)
        return RoundOutcome(group_info.group_id, peer_ids, metas, claims.weights, True, "", runner.sent_bytes)

    def _note_bad_senders(self) -> None:
        """Senders the last runner caught with bad gradients are refused in the next rounds (this one is
        incomplete already: their parts were not averaged)."""
        runner, self._last_runner = getattr(self, "_last_runner", None), None
        for peer in runner.bad_senders if runner is not None else ():
            self._suspects[peer] = (self._round_step or 0) + SUSPECT_STEPS
            logger.warning(f"sender {peer} sent a gradient slice that is not finite or exceeds its declared norm")

    async def _run_exact_allreduce(self, tensors, group_info, fractions, sender_weights, declared_norms=(), **kwargs):
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_info.group_id,
            ordered_peer_ids=group_info.peer_ids,
            peer_fractions=fractions,
            sender_weights=sender_weights,
            declared_norms=declared_norms,
            round_step=self._round_step,
            residuals=self._residuals,
            **kwargs,
        )
        self._last_runner = runner
        assert group_info.group_id in self._running_groups, "group was not registered"
        self._running_groups[group_info.group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
        else:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
        return runner


def raise_matchmaking(reason: str):
    from hivemind.averaging.matchmaking import MatchmakingException

    raise MatchmakingException(reason)
