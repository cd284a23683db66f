"""Helpers shared by the baseline peers (run as scripts from this folder): the task as swarmrun builds it, its
data order, and JSON-line events."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Iterator, Mapping, Sequence

import torch

from swarmrun.node import Task, batch_len, coerce_args, load_task_class
from swarmrun.protocol.cursor import block_examples, block_order, num_blocks


def parse_sets(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out


def build_task(name: str, sets: Mapping[str, str], seed: int) -> tuple[Task, dict[str, Any]]:
    """The task and the run's hyperparameters, split from ``--set`` pairs exactly as ``node join --task`` does."""
    cls = load_task_class(name)
    task_sets = {k: v for k, v in sets.items() if k in cls.arg_defaults}
    hp_sets = {k: v for k, v in sets.items() if k in cls.hparam_defaults}
    unknown = sorted(set(sets) - set(task_sets) - set(hp_sets))
    if unknown:
        raise SystemExit(f"unknown --set key(s) {unknown} for task {name!r}")
    hparams = coerce_args(cls.hparam_defaults, hp_sets, what="hyperparameter")
    return cls(task_sets, seed), hparams


def build_model_and_optimizer(task: Task, hparams: Mapping[str, Any], seed: int):
    torch.manual_seed(seed)  # as swarmrun's initial_state: only for tasks that use the global RNG
    model = task.build_model()
    optimizer = task.build_optimizer(model, hparams)
    scheduler = task.build_scheduler(optimizer, hparams)
    return model, optimizer, scheduler


def batches(task: Task, hparams: Mapping[str, Any], seed: int, batch_size: int, start: int = 0) -> Iterator[Any]:
    """Local batches in the run's data order: the seeded block permutation of each data epoch (as swarmrun's
    cursor), ``ceil(batch_size / block_size)`` blocks per batch, starting at position ``start`` of the order."""
    block_size, n_examples = int(hparams["block_size"]), task.num_examples()
    n_blocks = num_blocks(n_examples, block_size)
    per_batch = max(1, math.ceil(batch_size / block_size))
    epoch, pos = 0, start % n_blocks
    while True:
        order = block_order(seed, epoch, n_blocks)
        while pos < n_blocks:
            blocks = order[pos:pos + per_batch]
            pos += len(blocks)
            yield task.get_batch([i for b in blocks for i in block_examples(b, block_size, n_examples)])
        epoch, pos = epoch + 1, 0


def count_blocks(name: str, sets: Mapping[str, str], seed: int) -> int:
    """Blocks in one data epoch of the run that ``--task name --set ...`` describes (builds the task once)."""
    task, hparams = build_task(name, sets, seed)
    return num_blocks(task.num_examples(), int(hparams["block_size"]))


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps(dict(event=event, time=time.time(), **fields)) + "\n")
    sys.stdout.flush()


__all__ = ["batch_len", "batches", "build_model_and_optimizer", "build_task", "count_blocks", "emit", "parse_sets"]
