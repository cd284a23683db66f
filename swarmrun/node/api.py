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
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from swarmrun.node.tasks.base import Task, register_task


def make_task(name: str, *, model: Callable[[], torch.nn.Module], dataset, loss: Callable[[torch.nn.Module, Any], torch.Tensor],
              optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, version: str = "1",
              hparams: Optional[Mapping[str, Any]] = None, collate: Optional[Callable[[list], Any]] = None) -> type[Task]:
    """A task class from a model factory, a map-style dataset (``len`` and ``[i]``), a loss and an optimizer factory.

    ``model()`` must build the same initial weights on every peer: seed inside it (the run's seed is passed to
    ``torch.manual_seed`` before it is called). The data fingerprint hashes the dataset's length and first and
    last examples' bytes; give ``version`` a new value whenever the dataset changes.
    """
    collate_fn = collate or torch.utils.data.default_collate

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

    FunctionTask.name, FunctionTask.version = name, version
    FunctionTask.__name__ = FunctionTask.__qualname__ = f"Task[{name}]"
    return FunctionTask


def train(task: type[Task], run_id: str, *, peers: Sequence[str] = (), create: bool = False,
          sets: Optional[Mapping[str, Any]] = None, state_dir: Optional[str] = None, batch_size: int = 16,
          device: str = "auto", max_steps: Optional[int] = None, listen: Sequence[str] = (), min_peers: int = 1,
          json: bool = False) -> str:
    """Create (``create=True``) or join (``peers=...``) a run of ``task`` and train until it ends.

    Returns:
        why this peer left: "finished", "max_steps" or "stopped".
    Raises:
        SwarmrunError: with the exit code the CLI would use.
    """
    from swarmrun.node.runtime import run_async
    from swarmrun.node.peer.build import DEFAULT_SEED
    from swarmrun.node.peer.join import JoinOptions, run_peer
    from swarmrun.node.output import Events, setup_logging
    from swarmrun.node.net.swarm import SwarmConfig, parse_maddrs
    from swarmrun.node.runtime import kill_descendants
    from swarmrun.node.peer.trainer import TrainerConfig

    register_task(task)
    setup_logging(json_mode=json)
    swarm = SwarmConfig(state_dir=Path(state_dir or os.environ.get("SWARMRUN_STATE_DIR") or Path.home() / ".swarmrun"),
                        initial_peers=parse_maddrs(peers, what="peers"),
                        **({"listen": parse_maddrs(listen, what="listen")} if listen else {}))
    opts = JoinOptions(run_id=run_id, task=task.name if create else None,
                       sets={k: str(v) for k, v in (sets or {}).items()}, seed=DEFAULT_SEED, swarm=swarm,
                       trainer=TrainerConfig(batch_size=batch_size, device=device, max_steps=max_steps,
                                             min_peers=min_peers))
    events = Events(json_mode=json)
    try:
        return run_async(run_peer(opts, events))
    finally:
        events.close()
        kill_descendants()
