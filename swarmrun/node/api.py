"""The library API: join a run from an existing PyTorch script.

    import swarmrun
    task = swarmrun.make_task("my-mlp", model=lambda: MyNet(), dataset=my_dataset, loss=my_loss,
                              optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    swarmrun.train(task, "my-run", create=True)              # on the first machine
    swarmrun.train(task, "my-run", peers=["/ip4/.../p2p/..."])  # on every other one

Every peer runs the same script, so the task is found locally (``register_task``), never over the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

import torch

from swarmrun.node.tasks.base import Task, register_task


SCHEDULES = ("cosine", "constant")


def make_task(name: str, *, model: Callable[[], torch.nn.Module], dataset, loss: Callable[[torch.nn.Module, Any], torch.Tensor],
              optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, version: str = "1",
              hparams: Optional[Mapping[str, Any]] = None, collate: Optional[Callable[[list], Any]] = None,
              scheduler: Any = "cosine", evaluate: Optional[Callable[[torch.nn.Module], float]] = None) -> type[Task]:
    """A task class from a model factory, a map-style dataset (``len`` and ``[i]``), a loss and an optimizer factory.

    Args:
        model: builds the same initial weights on every peer (the run's seed goes to ``torch.manual_seed`` first).
        dataset: the training examples. A batch is ``collate([dataset[i] ...])``; its samples are counted along
            the first dimension of its first tensor (a sequence-first model transposes inside ``loss``). Blocks of
            examples come in a shuffled order, so a model that carries state across batches (an RNN's hidden
            state) cannot keep it: start each batch from zeros.
        scheduler: ``"cosine"`` (linear warm-up over ``warmup_steps``, cosine decay to 10% over ``total_steps``),
            ``"constant"``, or ``f(optimizer) -> LRScheduler`` stepped once per committed step (the same on every
            peer). A schedule that needs a metric (``ReduceLROnPlateau``) is not supported.
        evaluate: ``f(model) -> float``, the run's evaluation (a validation loss, say), called on every peer with
            the same state after each ``eval_every`` steps and at the end (the `eval` event); default: the loss on
            the first 64 training examples.
        hparams: ``Task.hparam_defaults`` to change, e.g. ``target_batch_size``, ``total_steps``, ``clip_norm``
            (default 1.0; 0: none). version: change it with the dataset (its fingerprint is partial).
    """
    collate_fn = collate or torch.utils.data.default_collate
    if not (callable(scheduler) or scheduler in SCHEDULES):
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULES)} or a function of the optimizer")

    class FunctionTask(Task):
        hparam_defaults = {**Task.hparam_defaults, **dict(hparams or {})}

        def data_fingerprint(self) -> str:
            h = hashlib.sha256(f"{name}:{version}:{len(dataset)}".encode())
            for i in {0, len(dataset) - 1}:
                h.update(repr(collate_fn([dataset[i]])).encode())
            return h.hexdigest()

        def num_examples(self) -> int:
            return len(dataset)

        def get_batch(self, indices: Sequence[int]):
            return collate_fn([dataset[i] for i in indices])

        def build_model(self) -> torch.nn.Module:
            torch.manual_seed(self.seed)
            return model()

        def loss(self, m, batch):
            return loss(m, batch)

        def build_optimizer(self, m, hp):
            return optimizer(m.parameters()) if optimizer else super().build_optimizer(m, hp)

        def build_scheduler(self, opt, hp):
            return _schedule(scheduler, opt) or super().build_scheduler(opt, hp)

        def evaluate(self, m, device):
            return _evaluate(evaluate, m) if evaluate is not None else super().evaluate(m, device)

    FunctionTask.name, FunctionTask.version = name, version
    FunctionTask.__name__ = FunctionTask.__qualname__ = f"Task[{name}]"
    return FunctionTask


def _schedule(scheduler, optimizer):
    """The scheduler ``make_task`` was given, or None for the default (cosine)."""
    if callable(scheduler):
        return scheduler(optimizer)
    if scheduler == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return None


def _evaluate(fn, model: torch.nn.Module) -> float:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(fn(model))
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class TrainResult:
    """What ``train`` returns: why this peer left, the step and ``state_hash`` it left at, and the trained model
    (the one ``make_task``'s ``model()`` built, trained in place; on CPU or the device it trained on)."""

    reason: str
    step: Optional[int]
    state_hash: Optional[str]
    model: Optional[torch.nn.Module]

    def __str__(self) -> str:
        return self.reason


def train(task: type[Task], run_id: str, *, peers: Sequence[str] = (), create: bool = False,
          sets: Optional[Mapping[str, Any]] = None, state_dir: Optional[str] = None, batch_size: int = 16,
          device: str = "auto", max_steps: Optional[int] = None, listen: Sequence[str] = (), min_peers: int = 1,
          json: bool = False, events: Optional[TextIO] = None, **config: Any) -> TrainResult:
    """Create (``create=True``) or join (``peers=...``) a run of ``task`` and train until it ends.

    Args:
        state_dir: this peer's identity (default ``~/.swarmrun``): two peers on one machine need two.
        json: events as JSON lines, to ``events`` (a text stream; default stdout, shared with the script's prints).
        config: any other ``TrainerConfig`` field, e.g. ``matchmaking_time``, ``averaging_timeout``,
            ``allreduce_timeout``, ``next_chunk_timeout``, ``vote_timeout``, ``state_timeout`` (seconds).
    Returns:
        a ``TrainResult`` (``str()`` of it is the reason: "finished", "max_steps" or "stopped").
    Raises:
        SwarmrunError: with the exit code the CLI would use. TypeError: an unknown ``config`` name.
    """
    from dataclasses import fields

    from swarmrun.node.net.swarm import SwarmConfig, parse_maddrs
    from swarmrun.node.output import Events, setup_logging
    from swarmrun.node.peer.build import DEFAULT_SEED
    from swarmrun.node.peer.join import JoinOptions, run_peer
    from swarmrun.node.peer.trainer import TrainerConfig
    from swarmrun.node.runtime import kill_descendants, run_async

    unknown = sorted(set(config) - {f.name for f in fields(TrainerConfig)})
    if unknown:
        raise TypeError(f"train() got unknown settings {', '.join(unknown)} (TrainerConfig's fields are known)")
    register_task(task)
    setup_logging(json_mode=json)
    swarm = SwarmConfig(state_dir=Path(state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun"),
                        initial_peers=parse_maddrs(peers, what="peers"),
                        **({"listen": parse_maddrs(listen, what="listen")} if listen else {}))
    opts = JoinOptions(run_id=run_id, task=task.name if create else None,
                       sets={k: str(v) for k, v in (sets or {}).items()}, seed=DEFAULT_SEED, swarm=swarm,
                       trainer=TrainerConfig(batch_size=batch_size, device=device, max_steps=max_steps,
                                             min_peers=min_peers, **config))
    sink = Events(json_mode=json, stream=events)
    kept: dict = {}
    try:
        reason = run_async(run_peer(opts, sink, keep=kept))
        return TrainResult(reason=reason, step=kept.get("step"), state_hash=kept.get("state_hash"),
                           model=kept.get("model"))
    finally:
        sink.close()
        kill_descendants()
