"""The baseline: the trace's task, seed and samples in one uninterrupted process, no swarm.

It starts from the very state a creating peer starts from (``make_spec`` + ``initial_state``) and for step ``k``
takes exactly as many samples as the swarm committed in its step ``k``, so losses compare at equal samples, step
by step. Which samples: given the blocks each of the swarm's steps applied (``blocks_per_step``, from the peers'
``step`` events), exactly those; otherwise the run's data order (the seeded block permutation of each data
epoch). Replaying the swarm's own blocks leaves out what data order alone does to a loss (on the shipped traces,
as much as the 2% the churn goal allows), so the comparison shows what the swarm itself did to the training.
Gradients are per-sample sums divided by the step's samples, clipped and stepped in fp32, as a peer does after
a round.
"""

from __future__ import annotations

import time
from typing import Iterator, Mapping, Optional, Sequence

import torch

from swarmrun.node import initial_state, make_spec
from swarmrun.node import batch_len, load_task_class
from swarmrun.protocol.cursor import block_examples, block_order, num_blocks


def _blocks(seed: int, n_blocks: int) -> Iterator[int]:
    epoch = 0
    while True:
        yield from block_order(seed, epoch, n_blocks)
        epoch += 1


def _step(state, tk, params: list, order: Iterator[int], target: int, *, batch_size: int, block_size: int,
          num_examples: int, clip: float) -> tuple[int, list[float]]:
    """One optimizer step on the next ``target`` samples of ``order``'s blocks, in batches of about ``batch_size``,
    sample-weighted and clipped as a swarm's step is. Returns the samples taken and each batch's loss."""
    bs, n_ex = block_size, num_examples
    got, losses = 0, []
    while got < target:
        indices: list[int] = []
        while got + len(indices) < target and len(indices) < batch_size:
            indices.extend(block_examples(next(order), bs, n_ex))
        batch = tk.get_batch(indices)
        n = batch_len(batch)
        loss = tk.loss(state.model, batch)
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
    return got, losses


def run_baseline(*, task: str, sets: Mapping[str, str], seed: int, samples_per_step: Sequence[int],
                 eval_steps: Sequence[int], batch_size: int = 64, order_shift: int = 0,
                 blocks_per_step: Optional[Sequence[Sequence[Sequence[int]]]] = None) -> dict:
    """Train ``len(samples_per_step)`` steps; evaluate at ``eval_steps``.

    ``blocks_per_step[k - 1]`` (``[start, end)`` ranges of block ids) are the blocks step ``k`` trains on, in place
    of the data order's next ones (``samples_per_step`` is then only checked against them). ``order_shift`` > 0
    walks another data order (the block permutations of seed + shift) with the same task, initial state and
    samples per step: how far such a baseline lands from the run's own is what data order alone does to the loss.

    Returns:
        ``{"eval": {step: loss}, "train": {step: loss}, "samples": {step: cumulative samples}, "seconds": s}``
    Raises:
        UsageError: the task or its arguments are unknown (as ``node join --task`` would say).
        ValueError: ``blocks_per_step`` does not hold one list per step, or its blocks are not the step's samples.
        LocalProtocolError: a block id outside the dataset's blocks.
    """
    t0 = time.perf_counter()
    spec, tk = make_spec(run_id="baseline", task_cls=load_task_class(task), sets={k: str(v) for k, v in sets.items()},
                         seed=seed, owner_key=b"")
    state = initial_state(spec, tk, "cpu")
    model, params = state.model, list(state.model.parameters())
    clip = float(spec.hparams.get("clip_norm", 0.0))
    n_ex, bs = spec.num_examples, spec.block_size
    order = _blocks(seed + order_shift, num_blocks(n_ex, bs))
    if blocks_per_step is not None:
        if len(blocks_per_step) != len(samples_per_step):
            raise ValueError(f"blocks for {len(blocks_per_step)} steps, samples for {len(samples_per_step)}")
        order = iter([b for ranges in blocks_per_step for start, end in ranges for b in range(start, end)])
    wanted = set(eval_steps)
    out: dict = {"eval": {}, "train": {}, "samples": {}}
    total = 0
    for step, target in enumerate(samples_per_step, start=1):
        model.train()
        if blocks_per_step is not None:  # exactly this step's blocks (the check below: they hold its samples)
            target = sum(len(block_examples(b, bs, n_ex)) for s, e in blocks_per_step[step - 1] for b in range(s, e))
            if target != samples_per_step[step - 1]:
                raise ValueError(f"step {step}: its blocks hold {target} samples, the swarm committed "
                                 f"{samples_per_step[step - 1]}")
        got, losses = _step(state, tk, params, order, target, batch_size=batch_size, block_size=bs, num_examples=n_ex,
                             clip=clip)
        total += got
        out["samples"][step] = total
        out["train"][step] = sum(losses) / len(losses) if losses else float("nan")
        if step in wanted:
            out["eval"][step] = tk.evaluate(model, torch.device("cpu"))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out
