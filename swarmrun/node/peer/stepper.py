"""The one thread that applies a peer's steps (commits and replayed step records).

Why (CI's kill test, then caught in the act): a joiner committed another state than its group about one run in six.
The averaged gradient, the optimizer state before and after, and the parameters before were the same bits on every
peer; the parameters after were not: one half of one weight matrix (a 2048-element chunk of a two-thread parallel
kernel, AdamW's ``sqrt``) was off by up to 3e-4 of the update, and the same kernel on the same input gave the right
bits when run again in that thread. A probe before the step showed it is the *first* parallel kernel run in the
applying thread that differs (two in fourteen runs), and then the step was right. The applying thread was the loop's
own or a default-executor thread that had done other work first (started the DHT, forked); a joiner computes no
gradient before its first commit, so its first parallel kernel was the step. Outside a peer process it did not
reproduce (bare, forked, threaded: 60 processes), so the mechanism below OpenMP is not known.

So every step a peer applies runs on one thread of its own that does nothing else, and that thread first runs a
step's kernels on fixed inputs until two runs agree (``warm_up``; it logs when the first run differed). Measured on
the kill test: a diverged state in 6 of 26 runs before (1 of 14 with the step on the loop thread), in none of 32
runs with this thread (its warm-up never found a difference). Gradient computation keeps the default executor:
different bits in a local gradient change only this peer's contribution, which every member averages alike.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

logger = logging.getLogger("swarmrun.trainer")

WARM_UP_SIZE = 1 << 16  # elements: above ATen's parallel grain (32768), so the kernel runs in parallel chunks
WARM_UP_RUNS = 5


def _probe() -> torch.Tensor:
    """The kernels of a step (clipping's norm, AdamW's moments, square root, division) on fixed inputs."""
    g = torch.linspace(-1e-2, 1e-2, WARM_UP_SIZE)
    g = g * (1.0 / (torch.linalg.vector_norm(g) + 1e-6))
    m, v = torch.zeros_like(g).lerp_(g, 0.1), torch.zeros_like(g).mul_(0.999).addcmul_(g, g, value=0.001)
    return torch.ones_like(g).addcdiv_(m, (v.sqrt() / 0.0316).add_(1e-8), value=-0.1)


def warm_up(runs: int = WARM_UP_RUNS) -> int:
    """Run a step's kernels until two runs give the same bits; how many runs disagreed with the next."""
    last = _probe()
    for disagreed in range(runs):
        now = _probe()
        if torch.equal(now, last):
            return disagreed
        last = now
    return runs


class StepThread:
    """A one-thread executor for a peer's optimizer steps, warmed up (``warm_up``) right before its first task: in
    the context the first apply runs in (the averager's process forked, the swarm met), where the bits differed."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmrun-step")
        self._warmed = False

    @staticmethod
    def _warm() -> None:
        try:
            disagreed = warm_up()
        except Exception as e:  # the steps run all the same; a warm-up is a precaution, not a step
            logger.warning(f"the step thread's warm-up failed: {type(e).__name__}: {e}")
            return
        if disagreed:
            logger.info(f"the step thread's first parallel kernels gave other bits than the next ({disagreed} "
                        f"run(s)); warmed up before its first step")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the step thread (after its warm-up: the executor runs tasks in order)."""
        if not self._warmed:
            self._warmed = True
            self._pool.submit(self._warm)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        """No step starts after this (one queued by a caller that was cancelled meanwhile is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def optimizer_step(state, params: list, grads: list, applied, *, clip: float) -> None:
    """Step ``state`` from ``step`` to ``step + 1`` with these gradients (one per parameter of ``params``, or None):
    clipped to ``clip`` (0: not), the optimizer and the schedule, then the step and the cursor advance by ``applied``.
    One code for a commit and a replay (the same bits); run on the ``StepThread``."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.device, dtype=p.dtype, copy=True)  # clipping works in place
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1
    state.cursor = state.cursor.apply(applied)
    for p in params:
        p.grad = None
