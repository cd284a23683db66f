"""A trainer's local work between two committed steps: what it does with the gradients of the blocks it computes.

``Accumulate`` adds them up toward one optimizer step (the default mode); ``InnerSteps`` takes inner optimizer steps
with them on the peer's own copy of the model (outer mode, ``node.peer.outer``). Both hand the round the same kind
of thing (``update``): a tensor per parameter and the divisor that makes it a mean, weighed by the claimed samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from swarmrun.node.peer.outer import Inner
from swarmrun.node.state.run import RunState
from swarmrun.node.tasks.base import Task, batch_len, batch_to
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.errors import IncompatibleState
from swarmrun.protocol.plan import inner_batch
from swarmrun.protocol.round import Claims
from swarmrun.protocol.spec import Spec


def backward(task: Task, model: torch.nn.Module, blocks: list[int], *, block_size: int, device: torch.device,
             mixed_precision: bool) -> tuple[float, int]:
    """Add the per-sample sum of gradients of these blocks to ``model``'s ``param.grad``; the mean loss and the
    samples."""
    batch = batch_to(task.batch_for_blocks(blocks, block_size), device)
    n = batch_len(batch)
    model.train()
    amp = device.type == "cuda" and mixed_precision
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
        loss = task.loss(model, batch)
    (loss.float() * n).backward()  # per-sample sum: any batch size weighs right
    return float(loss.detach()), n


def mean_norm(update: tuple[list[Optional[torch.Tensor]], int]) -> float:
    """The norm of an update's mean (-1 where it is not finite): what a round member declares."""
    tensors, divisor = update
    norms = [t.detach().float().norm() for t in tensors if t is not None]
    value = float(torch.stack(norms).norm()) / max(1, divisor) if norms else 0.0
    return value if math.isfinite(value) else -1.0


@dataclass
class Ahead:
    """The next step's work, computed while this peer's round communicates (``outer_overlap``): its blocks and
    samples, also in the trainer's ``claims`` and ``samples`` until the round ends (leased like the round's): a commit
    keeps them for the next step, an abandoned round drops them (``before``: the round's own claims and samples; else
    the next attempt would bring more than the part planned). At most ``part`` samples (the round's, as planned)."""

    part: int
    data_epoch: int
    before: tuple[int, Claims]
    claims: Claims = field(default_factory=Claims)
    samples: int = 0

    def add(self, blocks: list[int], samples: int) -> None:
        self.claims.add(blocks)
        self.samples += samples

    def carries(self, applied: RangeSet, data_epoch: int) -> bool:
        """Whether this work goes on after a commit of ``applied`` that left the cursor at ``data_epoch``: none of its
        blocks was applied and the data epoch is the same."""
        return data_epoch == self.data_epoch and applied.intersect(self.claims.blocks).is_empty


class Accumulate:
    """Gradients accumulate per sample in the run state's ``param.grad``; the commit clips their average."""

    clips_commit = True

    def __init__(self, *, spec: Spec, task: Task, state: RunState, device: torch.device, config):
        self.spec, self.task, self.state, self.device, self.config = spec, task, state, device, config

    def batch(self, quota: int) -> int:
        """Samples to compute next (of what is left of this peer's part ``quota``)."""
        return self.config.batch_size

    def compute(self, blocks: list[int]) -> tuple[float, int]:
        """Add these blocks' gradients (runs in a worker thread); the mean loss and the samples."""
        return backward(self.task, self.state.model, blocks, block_size=self.state.cursor.block_size,
                        device=self.device, mixed_precision=self.config.mixed_precision)

    def update(self, samples: int) -> tuple[list[Optional[torch.Tensor]], int]:
        """What this peer brings to the round: the per-sample sum of gradients and the samples."""
        return [p.grad for p in self.state.model.parameters()], samples

    def stale(self, state_hash: str) -> bool:
        return False

    def reset(self, state_hash: str) -> None:
        """Drop the local work (after a commit, a re-sync, a refused claim)."""
        for p in self.state.model.parameters():
            p.grad = None

    def fields(self) -> dict:
        return {}

    def hold(self) -> None:
        """The round took this peer's update; local work goes on beside it (outer mode's overlap only)."""
        raise NotImplementedError("only outer mode overlaps its round with the next local work")

    def release(self) -> None:
        """The round is over without a commit: drop the work since ``hold`` (the round's is kept)."""

    def carry(self, state_hash: str) -> None:
        """The round committed: keep what was computed since ``hold`` on top of the new state (else ``reset``)."""
        self.reset(state_hash)


class InnerSteps(Accumulate):
    """Outer mode: each computed batch (this peer's part / ``inner_steps`` samples, in batches of at most
    ``batch_size``) is one inner step on the peer's inner model; the update is the pseudo-gradient (committed minus
    inner parameters, a mean already). The inner steps clip their gradients; the commit does not clip."""

    clips_commit = False

    def __init__(self, *, inner: Inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self._sent: Optional[tuple[list[torch.Tensor], int]] = None  # (inner parameters, inner steps) at ``hold``

    def batch(self, quota: int) -> int:
        return inner_batch(quota, self.spec.inner_steps)

    def compute(self, blocks: list[int]) -> tuple[float, int]:
        per = max(1, self.config.batch_size // self.state.cursor.block_size)
        total_loss, total = 0.0, 0
        for i in range(0, len(blocks), per):
            loss, n = backward(self.task, self.inner.model, blocks[i:i + per], block_size=self.state.cursor.block_size,
                               device=self.device, mixed_precision=self.config.mixed_precision)
            total_loss, total = total_loss + loss * n, total + n
        self.inner.step(total, clip=float(self.spec.hparams.get("clip_norm", 0.0)))
        return total_loss / max(1, total), total

    def update(self, samples: int) -> tuple[list[Optional[torch.Tensor]], int]:
        return self.inner.pseudo_gradient(self.state.model), 1

    def stale(self, state_hash: str) -> bool:
        """Inner work belongs to the committed state it started from: is that another one than ``state_hash``?"""
        return self.inner.base != state_hash

    def reset(self, state_hash: str) -> None:
        """Start the inner model again from the committed state, at the schedule's learning rate of its step."""
        self._sent = None
        self.inner.restart(self.state.model, base=state_hash, lr=self._lr())

    def _lr(self) -> Optional[list[float]]:
        sched = self.state.scheduler
        return sched.get_last_lr() if hasattr(sched, "get_last_lr") else None

    def fields(self) -> dict:
        """The inner steps this peer took toward the step (a field of its step event; with an overlap, those the
        round took)."""
        return {"inner_steps": self.inner.steps if self._sent is None else self._sent[1]}

    def hold(self) -> None:
        """Remember the inner parameters the round's pseudo-gradient was taken at (a copy: inner steps go on)."""
        self._sent = ([p.detach().clone() for p in self.inner.model.parameters()], self.inner.steps)

    def release(self) -> None:
        """Put the inner parameters back where the round took them (the inner optimizer's moments keep the steps
        dropped: they are the peer's own, not the run's state)."""
        if self._sent is None:
            return
        (sent, steps), self._sent = self._sent, None
        with torch.no_grad():
            for p, then in zip(self.inner.model.parameters(), sent):
                p.copy_(then)
                p.grad = None  # (a batch that failed half-way)
        self.inner.steps = steps

    def carry(self, state_hash: str) -> None:
        """The next outer step starts from the committed state plus the inner steps taken during the round
        (``Inner.rebase``); without a ``hold``, from the committed state (``reset``)."""
        if self._sent is None:
            self.reset(state_hash)
            return
        (sent, steps), self._sent = self._sent, None
        self.inner.rebase(self.state.model, sent, base=state_hash, steps=self.inner.steps - steps, lr=self._lr())


def make_work(*, spec: Spec, task: Task, state: RunState, device: torch.device, config) -> Accumulate:
    """The local work of the run's mode.

    Raises:
        IncompatibleState: a run in outer mode with a state not built for it (``build.initial_state``).
    """
    if spec.outer == "none":
        return Accumulate(spec=spec, task=task, state=state, device=device, config=config)
    if state.inner is None:
        raise IncompatibleState("a run in outer mode needs a state built for it (build.initial_state)")
    return InnerSteps(inner=state.inner, spec=spec, task=task, state=state, device=device, config=config)
