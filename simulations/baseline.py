"""The baseline: the trace's task, seed and samples in one uninterrupted process, no swarm.

It starts from the very state a creating peer starts from (``make_spec`` + ``initial_state``), walks the run's
data order (the seeded block permutation of each data epoch), and for step ``k`` takes exactly as many samples
as the swarm committed in its step ``k``, so losses compare at equal samples, step by step. Gradients are
per-sample sums divided by the step's samples, clipped and stepped in fp32, as a peer does after a round.
"""

from __future__ import annotations

import time
from typing import Iterator, Mapping, Sequence

import torch

from swarmrun.node.join import initial_state, make_spec
from swarmrun.node.task import batch_len, load_task_class
from swarmrun.protocol.cursor import block_examples, block_order, num_blocks


def _blocks(seed: int, n_blocks: int) -> Iterator[int]:
    epoch = 0
    while True:
        yield from block_order(seed, epoch, n_blocks)
        epoch += 1


def run_baseline(*, task: str, sets: Mapping[str, str], seed: int, samples_per_step: Sequence[int],
                 eval_steps: Sequence[int], batch_size: int = 64, order_shift: int = 0) -> dict:
    """Train ``len(samples_per_step)`` steps; evaluate at ``eval_steps``. ``order_shift`` > 0 walks another data
    order (the block permutations of seed + shift) with the same task, initial state and samples per step: how
    far such a baseline lands from the run's own is the loss comparison's noise floor (a swarm's peers take
    the blocks of a step in another order than one process does).

    Returns:
        ``{"eval": {step: loss}, "train": {step: loss}, "samples": {step: cumulative samples}, "seconds": s}``
    Raises:
        UsageError: the task or its arguments are unknown (as ``node join --task`` would say).
    """
    t0 = time.perf_counter()
    spec, tk = make_spec(run_id="baseline", task_cls=load_task_class(task), sets={k: str(v) for k, v in sets.items()},
                         seed=seed, owner_key=b"")
    state = initial_state(spec, tk, "cpu")
    model, params = state.model, list(state.model.parameters())
    clip = float(spec.hparams.get("clip_norm", 0.0))
    n_ex, bs = spec.num_examples, spec.block_size
    order = _blocks(seed + order_shift, num_blocks(n_ex, bs))
    wanted = set(eval_steps)
    out: dict = {"eval": {}, "train": {}, "samples": {}}
    total = 0
    for step, target in enumerate(samples_per_step, start=1):
        model.train()
        got, losses = 0, []
        while got < target:
            indices: list[int] = []
            while got + len(indices) < target and len(indices) < batch_size:
                indices.extend(block_examples(next(order), bs, n_ex))
            batch = tk.get_batch(indices)
            n = batch_len(batch)
            loss = tk.loss(model, batch)
            (loss.float() * n).backward()
            got += n
            losses.append(float(loss.detach()))
        for p in params:
            if p.grad is not None:
                p.grad.div_(got)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        total += got
        out["samples"][step] = total
        out["train"][step] = sum(losses) / len(losses)
        if step in wanted:
            out["eval"][step] = tk.evaluate(model, torch.device("cpu"))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out
