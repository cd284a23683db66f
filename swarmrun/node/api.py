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
from swarmrun.protocol.spec import choose_budget


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
        scheduler: ``"cosine"`` (linear warm-up over ``warmup_steps``, cosine decay to 10% over ``total_steps``,
            the planned steps under a sample budget), ``"constant"``, or ``f(optimizer) -> LRScheduler`` stepped
            once per committed step (the same on every peer). ``f`` may return a ``ReduceLROnPlateau``: it is then
            stepped with ``evaluate(model)`` after every ``eval_every``-th step (``OnEvaluation``), which every
            peer computes on the same state, so the schedule is the same everywhere.
        evaluate: ``f(model) -> float``, the run's evaluation (a validation loss, say), called on every peer with
            the same state after each ``eval_every`` steps and at the end (the `eval` event); default: the loss on
            the first 64 training examples. It must depend on the model's weights only (a fixed validation set).
        hparams: ``Task.hparam_defaults`` to change, e.g. ``target_batch_size``, ``clip_norm`` (default 1.0; 0:
            none) and the run's length: ``total_steps``, or ``total_samples`` or ``epochs`` (whole passes over
            ``dataset``) instead. version: change it with the dataset (its fingerprint is partial).
    """
    if not (callable(scheduler) or scheduler in SCHEDULES):
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULES)} or a function of the optimizer")
    parts = dict(model=model, dataset=dataset, loss=loss, optimizer=optimizer, scheduler=scheduler,
                 evaluate=evaluate, collate=collate or torch.utils.data.default_collate)
    # a sample budget in ``hparams`` replaces the base class's total_steps
    defaults = choose_budget({**Task.hparam_defaults, **dict(hparams or {})}, set(hparams or {}))
    return type(f"Task[{name}]", (_FunctionTask,), dict(name=name, version=version, hparam_defaults=defaults,
                                                         parts=parts, __qualname__=f"Task[{name}]"))


class _FunctionTask(Task):
    """A task made of the functions ``make_task`` was given (``parts``)."""

    parts: dict = {}
    schedule = None  # the scheduler built last (its cached evaluation serves the `eval` event)

    def data_fingerprint(self) -> str:
        dataset, collate = self.parts["dataset"], self.parts["collate"]
        h = hashlib.sha256(f"{self.name}:{self.version}:{len(dataset)}".encode())
        for i in {0, len(dataset) - 1}:
            h.update(repr(collate([dataset[i]])).encode())
        return h.hexdigest()

    def num_examples(self) -> int:
        return len(self.parts["dataset"])

    def get_batch(self, indices: Sequence[int]):
        return self.parts["collate"]([self.parts["dataset"][i] for i in indices])

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return self.parts["model"]()

    def loss(self, m, batch):
        return self.parts["loss"](m, batch)

    def build_optimizer(self, m, hp):
        self.model = m  # a schedule stepped on the evaluation evaluates this model (built right after)
        optimizer = self.parts["optimizer"]
        return optimizer(m.parameters()) if optimizer else super().build_optimizer(m, hp)

    def build_scheduler(self, opt, hp):
        built = _schedule(self.parts["scheduler"], opt) or super().build_scheduler(opt, hp)
        self.schedule = _on_evaluation(built, self, hp)
        return self.schedule

    def evaluate(self, m, device):
        cached = self.schedule.cached() if isinstance(self.schedule, OnEvaluation) else None
        if cached is not None:
            return cached
        fn = self.parts["evaluate"]
        return _evaluate(fn, m) if fn is not None else super().evaluate(m, device)


def _on_evaluation(built, task: _FunctionTask, hparams: Mapping[str, Any]):
    """``built``, or an ``OnEvaluation`` around it when it is a ``ReduceLROnPlateau``."""
    if not isinstance(built, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return built
    fn = task.parts["evaluate"]
    if fn is None or int(hparams.get("eval_every", 0)) <= 0:
        raise ValueError("a ReduceLROnPlateau schedule needs make_task(evaluate=...) and eval_every > 0")
    return OnEvaluation(built, evaluate=lambda: _evaluate(fn, task.model), every=int(hparams["eval_every"]))


def _schedule(scheduler, optimizer):
    """The scheduler ``make_task`` was given, or None for the default (cosine)."""
    if callable(scheduler):
        return scheduler(optimizer)
    if scheduler == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return None


class OnEvaluation:
    """A ``ReduceLROnPlateau`` stepped with the run's evaluation after every ``every``-th committed step.

    Deterministic on every peer: it is stepped inside the optimizer step (for a committed step and a replayed
    step record alike), on the weights of that step, which every peer holds alike; its state (the plateau's best
    value and count of bad evaluations, with the lr in the optimizer's state) is part of the run's state, so a
    joiner continues it. Nothing local (a clock, a count of this peer's own batches) enters it.
    """

    def __init__(self, plateau: torch.optim.lr_scheduler.ReduceLROnPlateau, *, evaluate: Callable[[], float],
                 every: int):
        self.plateau, self.evaluate, self.every = plateau, evaluate, every
        self.last_epoch = 0  # committed steps this schedule has seen
        self._cache: Optional[tuple[int, float]] = None  # (step, value) of the last evaluation

    def step(self) -> None:
        self.last_epoch += 1
        if self.last_epoch % self.every == 0:
            value = float(self.evaluate())
            self._cache = (self.last_epoch, value)
            self.plateau.step(value)

    def cached(self) -> Optional[float]:
        """The evaluation of the current step, when this schedule made it (the `eval` event reuses it)."""
        return self._cache[1] if self._cache is not None and self._cache[0] == self.last_epoch else None

    def get_last_lr(self) -> list[float]:
        return self.plateau.get_last_lr()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.plateau.load_state_dict(dict(state["plateau"]))
        self._cache = None


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
          json: bool = False, events: Optional[TextIO] = None, seed: Optional[int] = None,
          **config: Any) -> TrainResult:
    """Create (``create=True``) or join (``peers=...``) a run of ``task`` and train until it ends.

    Args:
        state_dir: this peer's identity (default ``~/.swarmrun``): two peers on one machine need two.
        seed: a created run's seed (its model's initialization and its data order); default swarmrun's own.
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
                        initial_peers=parse_maddrs(peers, what="peers", peer_ids=True),
                        **({"listen": parse_maddrs(listen, what="listen")} if listen else {}))
    opts = JoinOptions(run_id=run_id, task=task.name if create else None,
                       sets={k: str(v) for k, v in (sets or {}).items()}, seed=DEFAULT_SEED if seed is None else seed,
                       swarm=swarm,
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
