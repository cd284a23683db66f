"""Error feedback for a lossy all-reduce codec (hparam ``error_feedback``, with ``compression`` other than none).

Each slice of a sender's contribution goes out once, encoded by the run's codec; the reducers average the decoded
bits (``averaging.ExactAllReduceRunner``). What the encoding lost, ``x - decode(encode(x))`` slice by slice, is
this peer's *residual*: the averager process writes it into shared buffers as each slice is encoded, and when the
round commits the peer adds it to its next contribution (the classic sender-side error feedback of 1-bit SGD and
EF-SGD), so the codec's error is carried forward instead of lost. The residual is the peer's own: it is neither
part of the run's state nor of any message, the committed gradient is still the same bits on every participant,
and a peer that leaves, re-syncs or commits alone starts again from none (README, "Error feedback").

``ResidualParts`` (in the averager process) knows which slice of the residual buffers each encoded slice is: the
same ``TensorPartContainer`` partition of the residual buffers, every participant's partition being the same.
``ErrorFeedback`` (in the peer) keeps the carried residual and adds it to the next round's contribution.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor


class ResidualParts:
    """The residual buffers cut the way an all-reduce cuts its tensors: ``record(peer_index, part_index, raw,
    sent)`` writes ``raw - sent`` where that slice of the contribution lies. Runs in the averager process; the
    buffers are zeroed at the round's start (a round that fails is never carried: ``ErrorFeedback.committed``)."""

    def __init__(self, residuals: Sequence[torch.Tensor], peer_fractions: Sequence[float], **container_kwargs):
        for r in residuals:
            r.zero_()
        self.parts = TensorPartContainer(residuals, peer_fractions, return_deltas=False, **container_kwargs)

    @torch.no_grad()
    def record(self, peer_index: int, part_index: int, raw: torch.Tensor, sent: torch.Tensor) -> None:
        view, _ = self.parts._input_parts_by_peer[peer_index][part_index]  # hivemind keeps the parts only there
        view.copy_(raw.float() - sent.float())

    def record_message(self, peer_index: int, part_index: int, raw: torch.Tensor, message) -> None:
        """The same for a slice as its message carries it (decoded as every reducer decodes it)."""
        self.record(peer_index, part_index, raw, deserialize_torch_tensor(message))


class ErrorFeedback:
    """The peer's side: shared residual buffers (created before the averager process starts) and the residual
    carried from the last committed round into the next one.

    The carry belongs to the step after the round that made it: a round at any other step (after a re-sync, a
    commit alone, a step taken from a replay) gets none, and an abandoned round leaves the carry as it was (its
    contribution is sent again, with the same carry). A round weighs each contribution by its samples: what a
    residual lost was ``samples * residual / total``, so the next contribution carries it scaled by the samples of
    the round that lost it over its own (the totals of two steps are both about ``target_batch_size``); a top-up of
    64 samples before a part of 900 would otherwise carry 14 times too little, and the reverse 14 times too much."""

    def __init__(self, like: Sequence[torch.Tensor]):
        # the averaged tensors' dtype: hivemind cuts tensors into parts by bytes per value, and so must the residuals
        self.residuals = [torch.zeros_like(t, device="cpu").share_memory_() for t in like]
        self.carry: Optional[list[torch.Tensor]] = None
        self.carry_step: Optional[int] = None  # the step whose round may use ``carry``
        self.carry_samples = 0  # the samples of the contribution whose encoding lost ``carry``

    @torch.no_grad()
    def add_to(self, buffers: Sequence[torch.Tensor], step: int, samples: int) -> float:
        """Add the carry (when it is this step's), scaled to a contribution of ``samples``, to the loaded one; the
        norm of what is now loaded (the norm a sender declares: reducers check its slices against it)."""
        if self.carry is not None and self.carry_step == step and samples > 0:
            for buf, c in zip(buffers, self.carry):
                buf.add_(c, alpha=self.carry_samples / samples)
        return float(torch.stack([b.float().norm() for b in buffers]).norm()) if buffers else 0.0

    @torch.no_grad()
    def committed(self, step: int, *, samples: int, delivered: bool = True) -> None:
        """The round at ``step`` committed: what its encoding lost is carried into the round at ``step + 1``.
        ``delivered`` False: this peer's claim was refused (weight 0), its contribution applied nowhere: the carry
        it held goes on to the next round as it was (the gradient it rode on is dropped)."""
        if not delivered:
            self.carry_step = step + 1 if self.carry_step == step else None
            return
        if self.carry is None:
            self.carry = [torch.empty_like(r) for r in self.residuals]
        for c, r in zip(self.carry, self.residuals):
            c.copy_(r)
        self.carry_step, self.carry_samples = step + 1, samples
