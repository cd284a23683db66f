"""``char-lm``: a small GPT-style byte-level language model.

The corpus is a byte string: by default swarmrun's own Python sources (the same bytes on every machine that
installs the same swarmrun version, whatever its Python), ``--set corpus=stdlib`` for the running Python's
standard-library sources, or the files of a directory given with ``--set corpus=DIR``. It is cut into non-overlapping windows of
``seq_len + 1`` bytes; example ``i`` is window ``i`` (the input is its first ``seq_len`` bytes, the
target the same bytes shifted by one). The model is a pre-LayerNorm transformer with causal
self-attention (``F.scaled_dot_product_attention``), learned positional embeddings and an untied
output head (untied so that every parameter has one name in the state).

Notes:
- ``corpus=stdlib`` depends on the Python version (its stdlib sources differ between releases), and so does
  the data fingerprint: peers on different Python versions refuse each other's spec. The default depends on
  the swarmrun version only (version 1 of this task used the stdlib by default: a mixed swarm of a CPU image
  on Python 3.11 and a CUDA image on 3.10 refused each other).
- The fingerprint covers the corpus bytes, not its path: the same files in another directory match.
- The evaluation batch (64 windows spread evenly over the corpus) is part of the training set; it
  measures fit, not generalization.
- ``dropout > 0`` draws its masks from torch's global RNG. Peers still hold identical states after a
  committed step (they apply the same averaged gradient), but one peer's gradient is only
  reproducible if the trainer restores that RNG. The default is 0.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from swarmrun.node.tasks.base import Task
from swarmrun.protocol.errors import TaskError
from swarmrun.node.tasks import seeded

VOCAB_SIZE = 256
#: directory names left out of the default (stdlib) corpus, at any depth
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
)


# --- corpus -----------------------------------------------------------------------------------
def _read_capped(root: Path, rel_paths: Sequence[str], max_bytes: int) -> bytes:
    """Concatenate the files in order until ``max_bytes`` bytes are read."""
    parts, size = [], 0
    for rel in rel_paths:
        if size >= max_bytes:
            break
        with open(root / rel, "rb") as f:
            data = f.read(max_bytes - size)
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def stdlib_corpus(max_bytes: int) -> bytes:
    """The default corpus: the stdlib's ``*.py`` files (no tests, no site-packages) in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        base = Path(dirpath).relative_to(root)
        rel_paths += [(base / f).as_posix() for f in filenames if f.endswith(".py")]
    rel_paths.sort()
    return _read_capped(root, rel_paths, max_bytes)


def package_corpus(max_bytes: int) -> bytes:
    """The default corpus: swarmrun's own ``*.py`` files in sorted path order (fixed by the installed version)."""
    root = Path(__file__).resolve().parents[2]  # the swarmrun package
    rel_paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return _read_capped(root, rel_paths, max_bytes)


def directory_corpus(path: str, max_bytes: int) -> bytes:
    """A user corpus: the regular files under ``path`` in sorted relative-path order.

    Hidden files and directories (names starting with ``.``, e.g. ``.git``) are left out; symbolic
    links to files are followed, to directories are not.

    Raises:
        TaskError: ``path`` is not a directory or holds no non-empty file.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise TaskError(f"task 'char-lm': corpus directory {str(root)!r} does not exist or is not a directory")
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        base = Path(dirpath)
        rel_paths += [
            (base / f).relative_to(root).as_posix()
            for f in filenames
            if not f.startswith(".") and (base / f).is_file()
        ]
    rel_paths.sort()
    data = _read_capped(root, rel_paths, max_bytes)
    if not data:
        raise TaskError(f"task 'char-lm': corpus directory {str(root)!r} holds no non-empty file")
    return data


# --- model ------------------------------------------------------------------------------------
class CausalSelfAttention(torch.nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc = torch.nn.Linear(d_model, 4 * d_model)
        self.proj = torch.nn.Linear(4 * d_model, d_model)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class CharGPT(torch.nn.Module):
    """Byte-level GPT: ``(batch, time) int64 -> (batch, time, 256)`` logits."""

    def __init__(self, *, seq_len: int, d_model: int, n_layer: int, n_head: int, dropout: float):
        super().__init__()
        self.tok_emb = torch.nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = torch.nn.Parameter(torch.empty(seq_len, d_model))
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, VOCAB_SIZE, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos_emb.shape[0]:
            raise ValueError(f"sequence of length {t} is longer than seq_len {self.pos_emb.shape[0]}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def init_from(self, g: torch.Generator) -> None:
        """Set every parameter from ``g`` (GPT-2 style): N(0, 0.02) weights, the residual projections
        scaled by 1/sqrt(2 * n_layer), zero biases, unit LayerNorm gains. Parameters are visited in
        ``named_parameters`` order, so the result depends only on the generator's seed."""
        resid_std = 0.02 / math.sqrt(2 * len(self.blocks))
        lns = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.LayerNorm)}
        for name, p in self.named_parameters():
            if id(p) in lns:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith("proj.weight"):
                p.copy_(seeded.randn(p.shape, g, resid_std))
            elif name.endswith("weight") or name == "pos_emb":
                p.copy_(seeded.randn(p.shape, g, 0.02))
            else:  # a parameter added without an init rule would stay uninitialized memory
                raise AssertionError(f"no init rule for parameter {name!r}")
        assert not list(self.buffers()), "buffers would stay uninitialized after to_empty()"


# --- task -------------------------------------------------------------------------------------
class CharLMTask(Task):
    """Byte-level language modelling with a small causal transformer.

    Task arguments: ``corpus`` ("" for swarmrun's own sources, "stdlib", or a directory), ``max_bytes``
    (4_000_000, the cap on the corpus), ``seq_len`` (64), ``d_model`` (128), ``n_layer`` (2),
    ``n_head`` (4), ``dropout`` (0.0). The corpus is read and hashed once, in ``__init__``.

    Raises:
        TaskError: a bad argument, a missing or empty corpus directory, a corpus shorter than one window.
    """

    name = "char-lm"
    version = "2"  # 2: the default corpus is swarmrun's own sources (1: the running Python's stdlib)
    arg_defaults = {
        "corpus": "",
        "max_bytes": 4_000_000,
        "seq_len": 64,
        "d_model": 128,
        "n_layer": 2,
        "n_head": 4,
        "dropout": 0.0,
    }
    hparam_defaults = {
        **Task.hparam_defaults,
        "lr": 3e-3,
        "weight_decay": 0.01,
        "warmup_steps": 10,
        "clip_norm": 1.0,
        "target_batch_size": 64,
        "total_steps": 200,
        "block_size": 8,
        "eval_every": 10,
    }

    def __init__(self, args, seed: int):
        super().__init__(args, seed)
        a = self.args
        for key in ("max_bytes", "seq_len", "d_model", "n_layer", "n_head"):
            if a[key] < 1:
                raise TaskError(f"task {self.name!r} argument {key!r} must be >= 1, got {a[key]}")
        if a["d_model"] % a["n_head"]:
            raise TaskError(f"task {self.name!r}: d_model {a['d_model']} is not a multiple of n_head {a['n_head']}")
        if not 0.0 <= a["dropout"] < 1.0:
            raise TaskError(f"task {self.name!r} argument 'dropout' must be in [0, 1), got {a['dropout']}")
        corpus = {"": package_corpus, "stdlib": stdlib_corpus}.get(a["corpus"], None)
        corpus = corpus(a["max_bytes"]) if corpus is not None else directory_corpus(a["corpus"], a["max_bytes"])
        window = a["seq_len"] + 1
        n = len(corpus) // window
        if n < 1:
            raise TaskError(
                f"task {self.name!r}: the corpus has {len(corpus)} bytes, fewer than one window of {window}"
            )
        h = hashlib.sha256()
        header = {"task": self.name, "version": self.version, "seq_len": a["seq_len"], "max_bytes": a["max_bytes"]}
        h.update(json.dumps(header, sort_keys=True).encode() + b"\0")
        h.update(corpus)
        self._fingerprint = h.hexdigest()
        self.corpus_bytes = len(corpus)
        self._windows = torch.frombuffer(bytearray(corpus[: n * window]), dtype=torch.uint8).view(n, window)

    def data_fingerprint(self) -> str:
        return self._fingerprint

    def num_examples(self) -> int:
        return int(self._windows.shape[0])

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``: int64 tensors of shape ``(len(indices), seq_len)``."""
        w = self._windows[seeded.check_indices(indices, self.num_examples())].long()
        return w[:, :-1], w[:, 1:]

    def eval_indices(self) -> Sequence[int]:
        """64 windows spread evenly over the corpus (all of them if there are fewer); they are also
        training examples."""
        n = self.num_examples()
        return range(n) if n <= 64 else [i * n // 64 for i in range(64)]

    def build_model(self) -> torch.nn.Module:
        """The initial transformer, from the seed's "model" generator stream (no global RNG)."""
        a = self.args
        with torch.device("meta"):  # constructing on meta consumes no global RNG
            model = CharGPT(
                seq_len=a["seq_len"],
                d_model=a["d_model"],
                n_layer=a["n_layer"],
                n_head=a["n_head"],
                dropout=a["dropout"],
            )
        model.to_empty(device="cpu")
        model.init_from(seeded.generator(self.seed, self.name, "model"))
        return model

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over all tokens, computed in fp32 (also under autocast)."""
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1))
