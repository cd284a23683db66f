"""Step records: the gradient a committed round gave the optimizer and the blocks it applied, as a frozen state
(served and fetched like one), so a peer one step behind replays the step instead of fetching the whole state."""

from __future__ import annotations

from typing import Optional, Sequence
import torch
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.errors import IncompatibleState
from swarmrun.protocol.manifest import DEFAULT_CHUNK_SIZE, build_manifest
from swarmrun.node.state.run import DTYPES, FrozenState, tensor_bytes


def make_step_record(*, spec_hash: str, step: int, grads: Sequence[Optional[torch.Tensor]], applied: RangeSet,
                     data_epoch: int, state_hash_before: str, state_hash_after: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     anchor: Optional[tuple[int, str]] = None) -> FrozenState:
    """The committed step ``step -> step + 1`` as a transferable object: the gradients the optimizer was given
    (after averaging, before clipping; None where a parameter had none) and the blocks it applied, and the history's
    anchor after the step (``ProgressReport.anchor``: a peer that replays the step takes it on)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    raws = [tensor_bytes(grads[i].detach().cpu()) for i in present]
    data = bytearray(sum(r.nbytes for r in raws))
    view, offset, described = memoryview(data), 0, []
    for i, raw in zip(present, raws):
        g = grads[i]
        view[offset:offset + raw.nbytes] = raw
        described.append((f"grad/{i}", DTYPES[g.dtype], tuple(g.shape), view[offset:offset + raw.nbytes]))
        offset += raw.nbytes
    manifest = build_manifest(spec_hash=spec_hash, step=step, tensors=described, chunk_size=chunk_size,
                              content={"kind": "step_record", "applied": applied.to_list(), "data_epoch": data_epoch,
                                       "params": len(grads), "state_hash_before": state_hash_before,
                                       "state_hash_after": state_hash_after,
                                       **({"anchor": list(anchor)} if anchor is not None else {})})
    return FrozenState(manifest=manifest, data=view.toreadonly())


def record_anchor(record: FrozenState) -> Optional[tuple[int, str]]:
    """The history's anchor after a step record's step; None from a record without one (an earlier build)."""
    value = record.manifest.content.get("anchor")
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and isinstance(value[1], str):
        return value[0], value[1]
    return None


def read_step_record(record: FrozenState) -> tuple[list[Optional[torch.Tensor]], RangeSet, str, str]:
    """The gradients (by parameter, None where absent), the applied blocks, and the state hashes before and
    after the step (a replay starts only from the first and must end on the second).

    Raises:
        IncompatibleState: the object is not a step record.
    """
    content = record.manifest.content
    if content.get("kind") != "step_record" or not isinstance(content.get("params"), int):
        raise IncompatibleState("object is not a step record")
    grads: list[Optional[torch.Tensor]] = [None] * content["params"]
    for name, t in record.tensors().items():
        kind, _, index = name.partition("/")
        if kind != "grad" or not index.isdigit() or int(index) >= len(grads):
            raise IncompatibleState(f"step record holds an unexpected tensor {name!r}")
        grads[int(index)] = t
    return (grads, RangeSet.from_list(content["applied"]), str(content.get("state_hash_before")),
            str(content.get("state_hash_after")))
