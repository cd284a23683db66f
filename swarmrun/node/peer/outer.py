"""Outer mode (``--set outer=diloco``): inner optimizer steps on a peer's own copy of the model, one outer step per
committed round.

A committed step is an outer step. Between two of them each trainer takes inner optimizer steps (the task's own
optimizer, on the blocks it claims) on its inner model, which starts from the committed parameters; the round
averages pseudo-gradients (start-of-step parameters minus the inner model's, weighted by the samples of the inner
steps) in the same averaged buffers, under the same claim decision and vote, and every participant applies the
outer optimizer (SGD, Nesterov momentum by default) to the run state's model with the identical averaged
pseudo-gradient. The run's state (``RunState.model``, its optimizer: the outer one, its schedule) never holds inner
work, so what a peer serves, snapshots and hashes is always a committed state; the inner model and optimizer are the
peer's own (``Inner``, ``RunState.inner``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch


def make_outer_optimizer(model: torch.nn.Module, hparams: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The outer optimizer of a run in outer mode: SGD with ``outer_lr``, ``outer_momentum`` and ``outer_nesterov``
    (the DiLoCo paper's 0.7, 0.9, Nesterov by default). Its state (the momentum buffers) is part of the run's state;
    ``foreach=False``: the same kernels on every peer of a device type."""
    return torch.optim.SGD(model.parameters(), lr=float(hparams["outer_lr"]),
                           momentum=float(hparams["outer_momentum"]), nesterov=bool(hparams["outer_nesterov"]),
                           foreach=False)


def pseudo_gradient(start: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``start - local`` per parameter, in fp32 on the CPU: the outer step's gradient (what the inner steps moved the
    parameters by, with the sign of a gradient)."""
    return [s.detach().float().cpu() - x.detach().float().cpu() for s, x in zip(start, local)]


@dataclass
class Inner:
    """A peer's inner model and optimizer (outer mode): its own, never part of the run's state.

    The inner optimizer's state (AdamW's moments) stays with the peer from one outer step to the next, as in DiLoCo; a
    peer that joins or restarts starts it fresh (zero moments), from the run's committed parameters.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    base: Optional[str] = None  # state_hash of the committed state the inner model started from (None: not started)
    steps: int = 0  # inner steps taken since ``base``

    @classmethod
    def build(cls, model: torch.nn.Module, *, task, hparams: Mapping[str, Any]) -> "Inner":
        """A copy of ``model`` with the task's optimizer on it."""
        inner_model = copy.deepcopy(model)
        return cls(model=inner_model, optimizer=task.build_optimizer(inner_model, hparams))

    def restart(self, model: torch.nn.Module, *, base: str, lr: Optional[Sequence[float]] = None) -> None:
        """Start the next outer step from the committed ``model`` (its parameters and buffers are copied); inner
        work since the last start is dropped. ``lr``: the schedule's learning rates of the committed step (the inner
        optimizer's groups take them: the schedule is part of the run's state, so every peer steps alike)."""
        with torch.no_grad():
            for mine, theirs in zip(self.model.state_dict().values(), model.state_dict().values()):
                mine.copy_(theirs)
        self._started(base, lr, steps=0)

    def rebase(self, model: torch.nn.Module, sent: Sequence[torch.Tensor], *, base: str, steps: int,
               lr: Optional[Sequence[float]] = None) -> None:
        """Start the next outer step from the committed ``model`` keeping the inner steps taken since the round took
        its pseudo-gradient (``sent``: the inner parameters then; ``steps`` of them since): each parameter becomes
        committed + (inner - sent), which is the committed parameter itself where no step moved it. Buffers are the
        committed ones. Those steps were computed at the older parameters: the overlap's delay of one round."""
        with torch.no_grad():
            for mine, theirs, then in zip(self.model.parameters(), model.parameters(), sent):
                mine.copy_(theirs.to(mine.device, mine.dtype) + (mine - then))
            for mine, theirs in zip(self.model.buffers(), model.buffers()):
                mine.copy_(theirs)
        self._started(base, lr, steps=steps)

    def _started(self, base: str, lr: Optional[Sequence[float]], *, steps: int) -> None:
        for p in self.model.parameters():
            p.grad = None
        if lr is not None:
            for group, value in zip(self.optimizer.param_groups, lr):
                group["lr"] = value
        self.base, self.steps = base, steps

    def step(self, samples: int, *, clip: float = 0.0) -> None:
        """One inner step on the per-sample sum of gradients in ``param.grad`` (``samples`` of them): their mean,
        clipped to ``clip`` (0: not clipped), through the inner optimizer."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(max(1, samples))
        if clip > 0 and params:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        self.optimizer.step()
        for p in self.model.parameters():
            p.grad = None
        self.steps += 1

    def pseudo_gradient(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The committed ``model``'s parameters minus this inner model's (see ``pseudo_gradient``)."""
        return pseudo_gradient(list(model.parameters()), list(self.model.parameters()))
