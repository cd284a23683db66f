"""The run's state on a peer: capture it as named tensors + msgpack content, apply a received one, hash it.

The state is logical (DESIGN.md): tensors are captured on CPU in their logical dtype, so a CUDA peer
and a CPU peer describe the same state with the same bytes; which device holds it is not part of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ..protocol.cursor import DataCursor
from ..protocol.errors import IncompatibleState
from ..protocol.manifest import DEFAULT_CHUNK_SIZE, Manifest, build_manifest

_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor (bfloat16 viewed as int16, since numpy lacks it)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def tensor_from_bytes(data: bytes | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    if dtype not in _TORCH_DTYPES:
        raise IncompatibleState(f"unsupported dtype {dtype!r} in state")
    torch_dtype = _TORCH_DTYPES[dtype]
    raw_dtype = torch.int16 if torch_dtype == torch.bfloat16 else torch_dtype
    t = torch.frombuffer(bytearray(data), dtype=raw_dtype) if len(data) else torch.empty(0, dtype=raw_dtype)
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(tuple(shape))


def digest_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the tensors, in order (the vote's gradient hash)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t.detach().cpu()))
    return h.hexdigest()


@dataclass
class RunState:
    """The training objects of a run on this peer, plus its step and cursor."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int
    cursor: DataCursor
    spec_hash: str
    seed: int
    info: dict = field(default_factory=dict)

    def capture(self) -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """Named CPU copies of every tensor of the state, and the msgpack content (the rest of it)."""
        tensors = [(f"model/{name}", t.detach().cpu().clone()) for name, t in self.model.state_dict().items()]
        opt = self.optimizer.state_dict()
        opt_scalars = {}
        for index, pstate in sorted(opt["state"].items()):
            for key, value in sorted(pstate.items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optimizer/{index}/{key}", value.detach().cpu().clone()))
                else:
                    opt_scalars[f"{index}/{key}"] = value
        content = {
            "cursor": self.cursor.to_dict(),
            # randomness of the run is counter-based: the seed and the step (and a block's index) determine it,
            # so no per-process RNG state is part of the training content
            "rng": {"kind": "counter", "seed": self.seed, "step": self.step},
            "optimizer": {"param_groups": _plain(opt["param_groups"]), "scalars": _plain(opt_scalars)},
            "scheduler": _plain({k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}),
        }
        return tensors, content

    def freeze(self, *, chunk_size: int = DEFAULT_CHUNK_SIZE, info: Optional[Mapping[str, Any]] = None) -> "FrozenState":
        """Copy the state into one buffer (tensors end to end) with its manifest: what providers serve and
        snapshots write, while training goes on with the live objects."""
        tensors, content = self.capture()
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        data = bytearray(total)
        view, offset, described = memoryview(data), 0, []
        for name, t in tensors:
            raw = tensor_bytes(t)
            view[offset:offset + raw.nbytes] = raw
            described.append((name, _DTYPES[t.dtype], tuple(t.shape), view[offset:offset + raw.nbytes]))
            offset += raw.nbytes
        manifest = build_manifest(spec_hash=self.spec_hash, step=self.step, tensors=described, content=content,
                                  info=dict(self.info if info is None else info), chunk_size=chunk_size)
        return FrozenState(manifest=manifest, data=view.toreadonly())

    def apply_frozen(self, frozen: "FrozenState") -> None:
        """Replace this peer's state with a frozen one (verified by whoever assembled it)."""
        self.apply(frozen.manifest, frozen.tensors())

    def manifest(self, *, chunk_size: int = DEFAULT_CHUNK_SIZE, captured=None) -> Manifest:
        tensors, content = captured if captured is not None else self.capture()
        return build_manifest(
            spec_hash=self.spec_hash,
            step=self.step,
            tensors=[(name, _DTYPES[t.dtype], tuple(t.shape), tensor_bytes(t)) for name, t in tensors],
            content=content,
            info=self.info,
            chunk_size=chunk_size,
        )

    def state_hash(self) -> str:
        return self.manifest().state_hash()

    def apply(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace this peer's state with a verified received one (tensors by manifest name, on CPU).

        Raises:
            IncompatibleState: the state is of another spec or does not fit this task's model.
        """
        if manifest.spec_hash != self.spec_hash:
            raise IncompatibleState(f"state of spec {manifest.spec_hash[:12]} cannot be applied to run of spec {self.spec_hash[:12]}")
        model_sd = self.model.state_dict()
        new_model = {}
        for name, ref in model_sd.items():
            t = tensors.get(f"model/{name}")
            if t is None or t.shape != ref.shape or t.dtype != ref.dtype:
                raise IncompatibleState(f"state does not fit the model: tensor {name!r} missing or of another shape")
            new_model[name] = t
        content = manifest.content
        opt_state: dict = {}
        for name, t in tensors.items():
            if name.startswith("optimizer/"):
                _, index, key = name.split("/", 2)
                opt_state.setdefault(int(index), {})[key] = t
        for path, value in content["optimizer"]["scalars"].items():
            index, key = path.split("/", 1)
            opt_state.setdefault(int(index), {})[key] = value
        device = next(self.model.parameters()).device
        with torch.no_grad():
            self.model.load_state_dict({k: v.to(device) for k, v in new_model.items()})
        groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in content["optimizer"]["param_groups"]]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        sched = self.scheduler.state_dict()  # keeps what is not state (lr_lambdas: functions of the task)
        sched.update(content["scheduler"])
        self.scheduler.load_state_dict(sched)
        received = DataCursor.from_dict(content["cursor"])
        received.check_same_data(self.cursor)  # a state must count this machine's data (size, fingerprint, seed)
        self.cursor = received
        self.step = manifest.step


@dataclass(frozen=True)
class FrozenState:
    """A state at one step, frozen: its manifest and its tensor bytes laid end to end in one read-only buffer.

    Providers serve chunks of it, snapshots write it, a joiner assembles one from chunks. Holding a reference
    keeps it alive: a transfer in progress pins the copy it started on while training moves on.
    """

    manifest: Manifest
    data: memoryview

    def __post_init__(self) -> None:
        if self.data.nbytes != self.manifest.total_bytes:
            raise IncompatibleState(f"state buffer holds {self.data.nbytes} bytes, its manifest {self.manifest.total_bytes}")

    @property
    def step(self) -> int:
        return self.manifest.step

    def chunk(self, index: int) -> memoryview:
        """The bytes of chunk ``index`` (a view, no copy)."""
        start, end = self.manifest.chunk_range(index)
        return self.data[start:end]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors by manifest name, as CPU tensors (copies)."""
        return {e.name: tensor_from_bytes(self.data[e.offset:e.offset + e.nbytes], e.dtype, e.shape)
                for e in self.manifest.tensors}

    def faults(self) -> list[str]:
        """Check every chunk and tensor digest against the manifest; the faults found (empty: it verifies)."""
        found = [f"chunk {i} does not match its hash" for i in range(len(self.manifest.chunks))
                 if not self.manifest.verify_chunk(i, self.chunk(i))]
        for e in self.manifest.tensors:
            if hashlib.sha256(self.data[e.offset:e.offset + e.nbytes]).hexdigest() != e.digest:
                found.append(f"tensor {e.name} does not match its hash")
        return found


def _plain(obj):
    """Make optimizer/scheduler metadata msgpack-able (tuples to lists, tensors to numbers)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item()
    return obj
