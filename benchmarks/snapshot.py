"""Snapshot write and load vs ``torch.save``/``torch.load`` of the same tensors, and the pause of training.

The state: an MLP of ``--layers`` square fp32 ``Linear(--width)`` layers with AdamW moments (one step taken),
about 300 MB with the defaults. Each figure is the median of ``--repeats`` runs:

- ``training_pause_s``: ``RunState.freeze()``, the in-memory copy the trainer makes after a commit; the
  snapshot writer takes it from there in a worker thread, so this is all training waits for;
- snapshot write: ``SnapshotStore.write`` into an empty store (every chunk written, fsynced, renamed);
- ``torch.save`` of ``{"model": state_dict, "optimizer": state_dict}``, then fsync (the snapshot fsyncs too);
- snapshot load: ``SnapshotStore.load`` (every chunk and tensor hash verified) vs ``torch.load``.

Ratios are throughput ratios: ``write_ratio_vs_torch_save = torch.save time / snapshot write time``
(goal >= 0.8), likewise for loads.

    /work/venv/bin/python benchmarks/snapshot.py [--layers 6] [--width 2048] [--repeats 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from swarmrun.node import SnapshotStore  # noqa: E402
from swarmrun.node import RunState  # noqa: E402
from swarmrun.protocol.cursor import DataCursor  # noqa: E402


def build_state(layers: int, width: int) -> RunState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return RunState(model=model, optimizer=opt, scheduler=sched, step=1,
                    cursor=DataCursor.new(seed=1, num_examples=4096, block_size=8), spec_hash="ab" * 32, seed=1)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_save(state: RunState, path: Path) -> None:
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed at the end)")
    ap.add_argument("--json", action="store_true", help="the last stdout line is one JSON object")
    args = ap.parse_args()
    if args.layers < 1 or args.width < 1 or args.repeats < 1:
        ap.error("--layers, --width and --repeats must be positive")
    root = Path(tempfile.mkdtemp(prefix="swarmrun-bench-snapshot-", dir=args.dir))
    try:
        state = build_state(args.layers, args.width)
        runs: dict[str, list[float]] = {k: [] for k in ("pause", "write", "save", "load", "torch_load")}
        size = 0
        for i in range(args.repeats):
            frozen = None

            def freeze():
                nonlocal frozen
                frozen = state.freeze()

            runs["pause"].append(timed(freeze))
            size = frozen.manifest.total_bytes
            store = SnapshotStore(str(root / f"store{i}"))
            runs["write"].append(timed(lambda: store.write(frozen, signed_spec=b"bench")))
            runs["save"].append(timed(lambda: torch_save(state, root / f"ckpt{i}.pt")))
            runs["load"].append(timed(lambda: store.load()))
            runs["torch_load"].append(timed(lambda: torch.load(root / f"ckpt{i}.pt", weights_only=True)))
            shutil.rmtree(root / f"store{i}")
            (root / f"ckpt{i}.pt").unlink()
        med = {k: statistics.median(v) for k, v in runs.items()}
        summary = dict(
            state_bytes=size, repeats=args.repeats,
            snapshot_write_s=round(med["write"], 3), torch_save_s=round(med["save"], 3),
            snapshot_load_s=round(med["load"], 3), torch_load_s=round(med["torch_load"], 3),
            write_ratio_vs_torch_save=round(med["save"] / med["write"], 3),
            load_ratio_vs_torch_load=round(med["torch_load"] / med["load"], 3),
            training_pause_s=round(med["pause"], 3),
            runs={k: [round(x, 3) for x in v] for k, v in runs.items()},
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    else:
        mb = size / 2**20
        print(f"state: {mb:.0f} MiB, median of {args.repeats}")
        print(f"{'':22}{'swarmrun':>10}{'torch':>10}{'ratio':>8}")
        print(f"{'write (s)':22}{med['write']:>10.3f}{med['save']:>10.3f}{summary['write_ratio_vs_torch_save']:>8.2f}")
        print(f"{'load (s)':22}{med['load']:>10.3f}{med['torch_load']:>10.3f}{summary['load_ratio_vs_torch_load']:>8.2f}")
        print(f"training pause (s): {med['pause']:.3f} (the in-memory copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
