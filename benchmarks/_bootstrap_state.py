"""The state the bootstrap benchmark moves, built the same way by every provider and joiner.

A stack of ``layers`` Linear(hidden, hidden) layers with Adam after one optimizer step (seeded random gradients,
so the moments exist and every provider holds the same bits without a forward pass), wrapped in swarmrun's
``RunState``. The default (6 x 2048) is ~25.2M parameters, ~302 MB with Adam's two moments.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager

from swarmrun.node import RunState
from swarmrun.node import ensure_identity, run_validators
from swarmrun.protocol.cursor import DataCursor

RAW_PROTOCOL = "/swarmrun-bench/raw/1"  # the ceiling: raw hivemind P2P binary streams, 1 MiB writes
RAW_WRITE = 1 << 20
MB = 1e6  # figures are in decimal megabytes (302 MB = 25.2M params x 3 x 4 bytes)
# a DHT RPC counts as lost after this many seconds (hivemind's default, 3 s, fails bootstraps on a loaded machine)
DHT_WAIT_TIMEOUT = 20.0


LOOPS = ("uvloop", "asyncio")


def run_loop(kind: str, coro):
    """Run ``coro`` on the event loop ``kind``: ``uvloop`` is what ``node`` runs on (``cli.run_async``),
    ``asyncio`` the standard library's."""
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def spec_hash_for(run_base: str) -> str:
    return hashlib.sha256(f"swarmrun-bench-bootstrap/{run_base}".encode()).hexdigest()


def run_id_for(run_base: str, k: int) -> str:
    """Each provider count gets its own run id, so a joiner's DHT lookup finds exactly ``k`` providers."""
    return f"{run_base}-k{k}"


def hivemind_prefix(run_base: str) -> str:
    return f"{run_base}_hm".replace("-", "_")


def make_dht(host: str, initial_peers: Sequence[str], state_dir: Path,
             run_ids: Sequence[str] = ()) -> tuple[DHT, Any]:
    """This peer's DHT (and p2pd) as swarmrun's ``start_dht`` makes it: its identity file in ``state_dir``, the
    signed-record validator with that key (provider records are signed) and the run-record validator for
    ``run_ids``. Returns the DHT and the key."""
    identity_path, key = ensure_identity(state_dir)
    dht = DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=list(initial_peers) or None,
              identity_path=identity_path, client_mode=False, record_validators=run_validators(key, run_ids),
              wait_timeout=DHT_WAIT_TIMEOUT)
    return dht, key


def build_state(*, hidden: int, layers: int, seed: int, run_base: str, stepped: bool) -> RunState:
    """The benchmark's state; ``stepped``: after one Adam step (a provider), else freshly built (a joiner: its
    weights come from another seed, so loading must replace every one of them; the run's seed is the same)."""
    torch.manual_seed(seed if stepped else seed + 7)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if stepped:
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    cursor = DataCursor.new(seed=seed, num_examples=4096, block_size=32)
    return RunState(model=model, optimizer=optimizer, scheduler=scheduler, step=1 if stepped else 0, cursor=cursor,
                    spec_hash=spec_hash_for(run_base), seed=seed)


def live_tensors(state: RunState) -> tuple[list[str], list[torch.Tensor]]:
    """Names and tensors of the state (the live ones, no copy: what hivemind's ``get_current_state`` hands over),
    in the order and with the names ``RunState.capture`` uses."""
    names, tensors = [], []
    for name, t in state.model.state_dict().items():
        names.append(f"model/{name}")
        tensors.append(t.detach())
    opt = state.optimizer.state_dict()
    for index, pstate in sorted(opt["state"].items()):
        for key, value in sorted(pstate.items()):
            if isinstance(value, torch.Tensor):
                names.append(f"optimizer/{index}/{key}")
                tensors.append(value.detach())
    return names, tensors


def apply_hivemind(state: RunState, metadata: dict, tensors: list[torch.Tensor]) -> None:
    """Load what hivemind's ``load_state_from_peers`` returned through the same ``RunState.apply`` swarmrun uses."""
    names = metadata["names"]
    if len(names) != len(tensors):
        raise ValueError(f"donor sent {len(tensors)} tensors for {len(names)} names")
    header = SimpleNamespace(spec_hash=metadata["spec_hash"], step=metadata["step"], content=metadata["content"])
    state.apply(header, dict(zip(names, tensors)))


class BenchAverager(DecentralizedAverager):
    """hivemind's state donor (and, with ``allow_state_sharing=False``, its joiner: hivemind names its RPC handlers
    after the class, so both sides use this one, as both sides of hivemind.Optimizer use TrainingStateAverager).
    ``get_current_state`` hands over the live tensors and the metadata to load them."""

    def __init__(self, *args, names=(), tensors=(), metadata=None, **kwargs):
        self._bench_names, self._bench_tensors = list(names), list(tensors)
        self._bench_metadata = dict(metadata or {})
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        return dict(self._bench_metadata, names=self._bench_names), self._bench_tensors
