"""The single-process baseline: a plain PyTorch loop on the same task, model, optimizer, schedule, per-step batch
and data order, no swarm. Each step accumulates per-sample gradients over local batches until
``target_batch_size`` samples, clips like swarmrun and steps. JSON lines on stdout: ``step`` after every step."""

from __future__ import annotations

import argparse
import sys

import torch

from _common import batch_len, batches, build_model_and_optimizer, build_task, emit, parse_sets


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="synthetic")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    args = p.parse_args()

    task, hparams = build_task(args.task, parse_sets(args.sets), args.seed)
    total_steps, target = int(hparams["total_steps"]), int(hparams["target_batch_size"])
    clip = float(hparams.get("clip_norm", 0.0))
    model, optimizer, scheduler = build_model_and_optimizer(task, hparams, args.seed)
    params = list(model.parameters())
    data = batches(task, hparams, args.seed, args.batch_size)
    model.train()
    emit("ready")
    for step in range(1, total_steps + 1):
        samples = 0
        while samples < target:
            batch = next(data)
            n = batch_len(batch)
            loss = task.loss(model, batch)
            (loss.float() * n).backward()  # per-sample sum, as swarmrun accumulates
            samples += n
        for q in params:
            if q.grad is not None:
                q.grad.div_(samples)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        emit("step", step=step, samples=samples, loss=float(loss.detach()))
    emit("left", step=total_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
