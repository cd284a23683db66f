"""The run's state on a peer: capture it as named tensors + msgpack content, apply a received one, hash it.

The state is logical (DESIGN.md): tensors are captured on CPU in their logical dtype, so a CUDA peer
and a CPU peer describe the same state with the same bytes; which device holds it is not part of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import mmap
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.errors import IncompatibleState
from swarmrun.protocol.manifest import DEFAULT_CHUNK_SIZE, DTYPE_ITEMSIZE, Manifest, build_manifest

DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor (bfloat16 viewed as int16, since numpy lacks it)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def alloc_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` for a state, not zero-filled in user space: an anonymous mmap, whose pages
    the kernel maps on first write (``bytearray(n)`` writes every page once more before it is used), and whose
    pages ``release_pages`` can hand back while views of its other parts live on."""
    if not nbytes:
        return memoryview(bytearray())
    # private: shared anonymous memory (mmap's default) is shmem, whose pages MADV_DONTNEED does not free
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, in one call
_PREFAULT_STEP = 8 << 20
_libc = None


def prefault(buffer: memoryview, start: int = 0, end: Optional[int] = None) -> bool:
    """Map the pages of ``buffer[start:end]`` (an ``alloc_buffer`` buffer) now, in one call per 8 MiB, instead of
    one page fault per 4 KiB page where it is first written (about 3x cheaper here; a joiner runs it in a thread
    ahead of the bytes arriving). Pages already mapped are left as they are. Returns False where the kernel (or
    the platform) cannot do it: the pages are then mapped on first write, as usual."""
    global _libc
    owner = buffer.obj if isinstance(buffer, memoryview) else buffer
    end = len(owner) if end is None else end
    if not isinstance(owner, mmap.mmap) or end <= start:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        pointer = ctypes.c_char.from_buffer(owner)  # an export of the mmap: released at the end of this call
        try:
            base = ctypes.addressof(pointer)
            page = mmap.PAGESIZE
            for lo in range(start // page * page, end, _PREFAULT_STEP):  # the GIL is released during each call
                if _libc.madvise(ctypes.c_void_p(base + lo), ctypes.c_size_t(min(_PREFAULT_STEP, end - lo)),
                                 _MADV_POPULATE_WRITE) != 0:
                    return False
        finally:
            del pointer
        return True
    except (OSError, AttributeError, TypeError, ValueError):
        return False


def release_pages(buffer: Any, keep: Sequence[tuple[int, int]]) -> int:
    """Hand the whole pages of an ``alloc_buffer`` buffer outside the ``keep`` ranges (``[start, end)``) back to
    the kernel (they read as zeros afterwards); returns the bytes released (0 for any other kind of buffer)."""
    if not isinstance(buffer, mmap.mmap):
        return 0
    page, released, pos = mmap.PAGESIZE, 0, 0
    for start, end in sorted(keep) + [(len(buffer), len(buffer))]:
        lo, hi = -(-pos // page) * page, start // page * page
        if hi > lo:
            buffer.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            released += hi - lo
        pos = max(pos, end)
    return released


def tensor_from_bytes(data: bytes | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    if dtype not in TORCH_DTYPES:
        raise IncompatibleState(f"unsupported dtype {dtype!r} in state")
    torch_dtype = TORCH_DTYPES[dtype]
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
    #: outer mode: this peer's inner model and optimizer (``node.peer.outer.Inner``). The peer's own, not part of the
    #: run's state: never captured, hashed or transferred
    inner: Any = None

    def capture(self) -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """Named CPU copies of every tensor of the state, and the msgpack content (the rest of it)."""
        tensors, content = self._live()
        return [(name, t.cpu().clone()) for name, t in tensors], content

    def _live(self) -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """The state's tensors by manifest name (the live ones, detached, on their device: not copies; read them
        only while no step runs), and the msgpack content (the rest of the state)."""
        tensors = [(f"model/{name}", t.detach()) for name, t in self.model.state_dict().items()]
        opt = self.optimizer.state_dict()
        opt_scalars = {}
        for index, pstate in sorted(opt["state"].items()):
            for key, value in sorted(pstate.items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optimizer/{index}/{key}", value.detach()))
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
        snapshots write, while training goes on with the live objects.

        One copy of each tensor (straight into the buffer) and one read of the buffer for both kinds of digest:
        this runs after every commit."""
        tensors, content = self._live()
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        buf = alloc_buffer(total)
        prefault(buf)
        offset, described = 0, []
        for name, t in tensors:
            raw = tensor_bytes(t.cpu())
            buf[offset:offset + raw.nbytes] = raw
            described.append((name, DTYPES[t.dtype], tuple(t.shape), buf[offset:offset + raw.nbytes]))
            offset += raw.nbytes
        manifest = build_manifest(spec_hash=self.spec_hash, step=self.step, tensors=described, content=content,
                                  info=dict(self.info if info is None else info), chunk_size=chunk_size)
        return FrozenState(manifest=manifest, data=buf.toreadonly())

    def apply_frozen(self, frozen: "FrozenState", *, adopt: bool = False) -> None:
        """Replace this peer's state with a frozen one (verified by whoever assembled it).

        Args:
            adopt: the state takes ``frozen``'s buffer as its memory: the optimizer's state tensors, and on CPU the
                model's parameters, become views of it (no copy, no fresh memory), and its pages nothing uses are
                handed back. Only for a state nobody else holds (the one ``Fetcher.fetch`` returns): ``frozen`` must
                not be used afterwards.
        """
        views = frozen.tensors(copy=False)
        # without adopt, the model's tensors are copied into its parameters; the optimizer keeps what it is given
        tensors = {name: t if adopt or not name.startswith("optimizer/") else t.clone() for name, t in views.items()}
        self.apply(frozen.manifest, tensors, adopt=adopt)
        if adopt:
            in_use = [p for p in self.model.parameters()] + [
                t for pstate in self.optimizer.state.values() for t in pstate.values() if isinstance(t, torch.Tensor)]
            frozen.release_unused(in_use)

    def manifest(self, *, chunk_size: int = DEFAULT_CHUNK_SIZE, captured=None) -> Manifest:
        tensors, content = captured if captured is not None else self._live()
        return build_manifest(
            spec_hash=self.spec_hash,
            step=self.step,
            tensors=[(name, DTYPES[t.dtype], tuple(t.shape), tensor_bytes(t.cpu())) for name, t in tensors],
            content=content,
            info=self.info,
            chunk_size=chunk_size,
        )

    def state_hash(self) -> str:
        return self.manifest().state_hash()

    def apply(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor], *, adopt: bool = False) -> None:
        """Replace this peer's state with a verified received one (tensors by manifest name, on CPU).

        Args:
            adopt: on a CPU model, the parameters take the given tensors as their data (no copy); they must be
                this peer's alone. The optimizer keeps the tensors it is given in any case.

        Raises:
            IncompatibleState: the state is of another spec or does not fit this task's model or data; nothing
                was changed then.
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
        received = DataCursor.from_dict(content["cursor"])
        received.check_same_data(self.cursor)  # a state must count this machine's data (size, fingerprint, seed)
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
            if adopt and device.type == "cpu":
                # ``param.data = t`` keeps each Parameter object (the optimizer and the trainer hold them)
                params = dict(self.model.named_parameters())
                for name in [n for n in new_model if n in params]:
                    params[name].data = new_model.pop(name)
            if new_model:  # everything without adopt; the buffers (e.g. norm statistics), tied names with it
                self.model.load_state_dict({k: v.to(device) for k, v in new_model.items()}, strict=not adopt)
        groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in content["optimizer"]["param_groups"]]
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        sched = self.scheduler.state_dict()  # keeps what is not state (lr_lambdas: functions of the task)
        sched.update(content["scheduler"])
        self.scheduler.load_state_dict(sched)
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

    def tensors(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The state's tensors by manifest name, as CPU tensors: copies, or (``copy=False``) views over this state's
        buffer where they can be (a tensor whose offset is not a multiple of its item size is copied), which must
        not be written while anyone else holds the state (a provider serving it, a snapshot being written)."""
        base = self._base()
        out = {}
        for e in self.manifest.tensors:
            if base is None or e.offset % DTYPE_ITEMSIZE[e.dtype]:
                out[e.name] = tensor_from_bytes(self.data[e.offset:e.offset + e.nbytes], e.dtype, e.shape)
                continue
            if e.dtype not in TORCH_DTYPES:
                raise IncompatibleState(f"unsupported dtype {e.dtype!r} in state")
            t = base[e.offset:e.offset + e.nbytes].view(TORCH_DTYPES[e.dtype]).reshape(e.shape)
            out[e.name] = t.clone() if copy else t
        return out

    def _base(self) -> Optional[torch.Tensor]:
        """The whole buffer as a uint8 tensor, over the writable memory behind ``data`` (torch has no read-only
        tensors), or None where there is none (``data`` over bytes, or a part of a larger buffer)."""
        owner = self.data.obj
        try:
            writable = memoryview(owner)
        except TypeError:
            return None
        if writable.readonly or writable.nbytes != self.data.nbytes or not self.data.nbytes:
            return None  # same size as ``data``: ``data`` is the whole of it, from its first byte
        return torch.frombuffer(owner, dtype=torch.uint8)

    def release_unused(self, in_use: Sequence[torch.Tensor]) -> int:
        """After an adopting apply: hand back the pages of this buffer that none of the tensors ``in_use`` lies in
        (the parts that were copied elsewhere); the bytes released. The state is not usable afterwards."""
        base = self._base()
        if base is None:
            return 0
        lo, hi, keep = base.data_ptr(), base.data_ptr() + base.numel(), []
        for t in in_use:
            if lo <= t.data_ptr() < hi:
                start = t.data_ptr() - lo
                keep.append((start, start + t.numel() * t.element_size()))
        return release_pages(self.data.obj, keep)

    def faults(self) -> list[str]:
        """Check every chunk and tensor digest against the manifest; the faults found (empty: it verifies)."""
        found = [f"chunk {i} does not match its hash" for i in range(len(self.manifest.chunks))
                 if not self.manifest.verify_chunk(i, self.chunk(i))]
        for e in self.manifest.tensors:
            if not self.manifest.verify_tensor(e, self.data[e.offset:e.offset + e.nbytes]):
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
