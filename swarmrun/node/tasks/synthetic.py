"""``synthetic``: a tiny regression problem generated from the run's seed, for tests and demos.

Inputs ``x ~ N(0, 1)`` of dimension ``dim``; targets ``y = x @ w + noise * N(0, 1)`` (one output) with
``w ~ N(0, 1/dim)`` drawn from the seed, so ``y`` has variance about 1. The model is a 2-layer MLP
(``dim -> hidden -> 1``, tanh). A step of batch 64 takes a few milliseconds on one CPU core.

Evaluation uses held-out examples of the same distribution (their own seeded stream, never trained on), so an
evaluated loss measures the function learnt, not how recently the data order visited a few training examples.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from swarmrun.node.tasks.base import Task
from swarmrun.protocol.errors import TaskError
from swarmrun.node.tasks import seeded


class SyntheticMLP(torch.nn.Module):
    """``dim -> hidden -> 1`` with tanh. Parameters are set by :meth:`SyntheticTask.build_model`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class SyntheticTask(Task):
    """Seeded linear-regression data and a 2-layer MLP.

    Task arguments: ``dim`` (16), ``hidden`` (32), ``num_examples`` (4096), ``noise`` (0.01, the
    standard deviation of the target noise), ``eval_examples`` (1024 held-out examples). The dataset and the
    evaluation examples are generated once, in ``__init__``.

    Raises:
        TaskError: a non-positive size or a negative noise.
    """

    name = "synthetic"
    version = "1"
    arg_defaults = {"dim": 16, "hidden": 32, "num_examples": 4096, "noise": 0.01, "eval_examples": 1024}
    hparam_defaults = {
        **Task.hparam_defaults,
        "lr": 1e-2,
        "warmup_steps": 0,
        "target_batch_size": 64,
        "total_steps": 50,
        "block_size": 8,
        "eval_every": 5,
    }

    def __init__(self, args, seed: int):
        super().__init__(args, seed)
        a = self.args
        for key in ("dim", "hidden", "num_examples", "eval_examples"):
            if a[key] < 1:
                raise TaskError(f"task {self.name!r} argument {key!r} must be >= 1, got {a[key]}")
        if a["noise"] < 0:
            raise TaskError(f"task {self.name!r} argument 'noise' must be >= 0, got {a['noise']}")
        g = seeded.generator(self.seed, self.name, "data")
        n, dim = a["num_examples"], a["dim"]
        # drawn and combined in float64, rounded once (see seeded): the same bits on every machine
        w = torch.randn((dim, 1), generator=g, dtype=torch.float64) / math.sqrt(dim)
        x = torch.randn((n, dim), generator=g, dtype=torch.float64)
        noise = torch.randn((n, 1), generator=g, dtype=torch.float64)
        self._x = x.to(torch.float32).contiguous()
        self._y = (x @ w + a["noise"] * noise).to(torch.float32).contiguous()
        g_eval = seeded.generator(self.seed, self.name, "eval")  # its own stream: the training data does not depend on it
        x = torch.randn((a["eval_examples"], dim), generator=g_eval, dtype=torch.float64)
        noise = torch.randn((a["eval_examples"], 1), generator=g_eval, dtype=torch.float64)
        self._eval = (x.to(torch.float32).contiguous(), (x @ w + a["noise"] * noise).to(torch.float32).contiguous())
        self._fingerprint = self._hash()

    def _hash(self) -> str:
        h = hashlib.sha256()
        # the training data only: the held-out evaluation set's size names no other data (and older runs keep theirs)
        args = {k: v for k, v in self.args.items() if k != "eval_examples"}
        header = {"task": self.name, "version": self.version, "args": args, "seed": self.seed}
        h.update(json.dumps(header, sort_keys=True).encode() + b"\0")
        for t in (self._x, self._y):
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def data_fingerprint(self) -> str:
        return self._fingerprint

    def num_examples(self) -> int:
        return int(self._x.shape[0])

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: float32 tensors of shape ``(len(indices), dim)`` and ``(len(indices), 1)``."""
        idx = seeded.check_indices(indices, self.num_examples())
        return self._x[idx], self._y[idx]

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of the ``eval_examples`` held-out examples."""
        return self._eval

    def build_model(self) -> torch.nn.Module:
        """The MLP with PyTorch's default-style uniform init, drawn from the seed's "model" stream."""
        with torch.device("meta"):  # no global RNG is consumed and no memory is written twice
            model = SyntheticMLP(self.args["dim"], self.args["hidden"])
        model.to_empty(device="cpu")
        g = seeded.generator(self.seed, self.name, "model")
        with torch.no_grad():
            for layer in (model.fc1, model.fc2):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.copy_(seeded.uniform(layer.weight.shape, g, bound))
                layer.bias.copy_(seeded.uniform(layer.bias.shape, g, bound))
        return model

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y.float())
