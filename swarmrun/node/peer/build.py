"""Build a run locally: its spec from ``--set`` pairs, the installed task it names, the initial state, the device."""

from __future__ import annotations

import re
import time
from typing import Mapping
import torch
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.errors import IncompatibleState, UsageError
from swarmrun.protocol.spec import (BUDGET_HPARAMS, OPTIONAL_HPARAMS, OUTER_DEFAULTS, Spec, choose_budget,
                                    outer_hparams)
from swarmrun.node.state.run import RunState
from swarmrun.node.tasks.base import Task, load_task_class
from swarmrun.protocol.errors import TaskError


DEFAULT_SEED = 20261202


def resolve_device(name: str) -> str:
    """``cpu``, ``cuda`` (or ``cuda:N``) or ``auto``.

    Raises:
        UsageError: the device is not there.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise UsageError(f"device {name!r} requested but CUDA is not available on this machine")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return name
    raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, not {name!r}")


def make_spec(*, run_id: str, task_cls: type[Task], sets: Mapping[str, str], seed: int, owner_key: bytes,
              access: str = "open") -> tuple[Spec, Task]:
    """A new run's spec from ``--set key=value`` pairs (task arguments and hyperparameters).

    The run's length is one of ``total_steps``, ``total_samples`` and ``epochs`` (``choose_budget``): one that is
    set replaces the task's default, so only a run that sets a sample budget carries one in its spec.

    Raises:
        UsageError: a key that is neither, a value of the wrong type.
    """
    from swarmrun.node.tasks.base import coerce_args

    task_sets = {k: v for k, v in sets.items() if k in task_cls.arg_defaults}
    hp_sets = {k: v for k, v in sets.items() if k in task_cls.hparam_defaults or k in BUDGET_HPARAMS}
    outer_sets = {k: v for k, v in sets.items() if k in OUTER_DEFAULTS and k not in hp_sets}
    optional_sets = {k: v for k, v in sets.items() if k in OPTIONAL_HPARAMS and k not in hp_sets}
    unknown = sorted(set(sets) - set(task_sets) - set(hp_sets) - set(outer_sets) - set(optional_sets))
    if unknown:
        known = ", ".join(sorted({*task_cls.arg_defaults, *task_cls.hparam_defaults, *OUTER_DEFAULTS,
                                  *OPTIONAL_HPARAMS}))
        raise UsageError(f"unknown --set key(s) {', '.join(unknown)} for task {task_cls.name!r} (known: {known})")
    try:
        hparams = coerce_args(choose_budget(task_cls.hparam_defaults, hp_sets), hp_sets, what="hyperparameter")
        # outer-mode hparams are in the spec only in outer mode (a default run's spec is as it was before them)
        hparams.update(outer_hparams(coerce_args(OUTER_DEFAULTS, outer_sets, what="hyperparameter"), given=outer_sets))
        # only a value other than its default goes into the spec: a run that says error_feedback=false has the spec
        # (and spec hash) of one that does not say it
        hparams.update({k: v for k, v in coerce_args(OPTIONAL_HPARAMS, optional_sets, what="hyperparameter").items()
                        if k in optional_sets and v != OPTIONAL_HPARAMS[k]})
        task = task_cls(task_sets, seed)
    except TaskError as e:
        raise UsageError(str(e)) from None
    for key in ("target_batch_size", "block_size", *(k for k in BUDGET_HPARAMS if k in hparams)):
        if int(hparams[key]) <= 0:
            raise UsageError(f"{key} must be positive, got {hparams[key]}")
    spec = Spec(run_id=run_id, task=task_cls.name, task_version=task_cls.version, task_args=dict(task.args),
                hparams=hparams, seed=seed, data_fingerprint=task.data_fingerprint(),
                num_examples=task.num_examples(), owner_key=owner_key, access=access, created_at=time.time())
    return spec, task


def build_task_for(spec: Spec) -> Task:
    """Build the installed task a spec names, refusing another version or another dataset.

    Raises:
        IncompatibleState: task missing, other version, other data fingerprint.
    """
    try:
        task_cls = load_task_class(spec.task)
    except TaskError as e:
        raise IncompatibleState(f"run {spec.run_id!r} needs {e}") from None
    if task_cls.version != spec.task_version:
        raise IncompatibleState(f"run {spec.run_id!r} uses task {spec.task!r} version {spec.task_version}, "
                                f"this machine has version {task_cls.version}")
    try:
        task = task_cls(dict(spec.task_args), spec.seed)
    except TaskError as e:
        raise IncompatibleState(f"cannot build task {spec.task!r} of run {spec.run_id!r}: {e}") from None
    if task.data_fingerprint() != spec.data_fingerprint:
        raise IncompatibleState(
            f"this machine's data for task {spec.task!r} differs from the run's (fingerprint "
            f"{task.data_fingerprint()[:12]} != {spec.data_fingerprint[:12]}); use the same corpus (--set corpus=DIR on "
            f"the run's creator) and the same Python/library versions")
    return task


def initial_state(spec: Spec, task: Task, device: str) -> RunState:
    """The run's state at step 0. In outer mode (``spec.outer == "diloco"``) the state's optimizer is the outer one
    (``outer.make_outer_optimizer``) and the task's optimizer is the peer's own inner one (``RunState.inner``, fresh);
    the task's schedule, part of the state, drives the inner learning rate by committed step."""
    torch.manual_seed(spec.seed)  # only for tasks that use the global RNG (dropout); models derive from the seed
    model = task.build_model().to(device)
    inner = None
    if spec.outer == "diloco":
        from swarmrun.node.peer.outer import Inner, make_outer_optimizer
        inner = Inner.build(model, task=task, hparams=spec.hparams)
        optimizer, scheduled = make_outer_optimizer(model, spec.hparams), inner.optimizer
    else:
        optimizer = scheduled = task.build_optimizer(model, spec.hparams)
    # under a sample budget the schedule's horizon is the planned number of steps (Spec.total_steps)
    scheduler = task.build_scheduler(scheduled, {**spec.hparams, "total_steps": spec.total_steps})
    cursor = DataCursor.new(seed=spec.seed, num_examples=spec.num_examples, block_size=spec.block_size,
                            data_fingerprint=spec.data_fingerprint)
    return RunState(model=model, optimizer=optimizer, scheduler=scheduler, step=0, cursor=cursor,
                    spec_hash=spec.spec_hash(), seed=spec.seed, inner=inner)
