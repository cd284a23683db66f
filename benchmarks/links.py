"""Training over capped links: bytes per sample, compute utilisation, speed and eval loss at equal samples, per mode.

Each mode is one run of 4 real ``node join`` peers, each in its own network namespace, every link capped by ``tc
tbf`` (``--rate``, 100 Mbit/s by default, both directions) and delayed ``--latency-ms`` each way (50 ms) by the
peer's delay proxy: the churn harness's ``simulations.Simulation`` with a trace of no faults. Every mode trains the
same task, seed and sample budget (synchronous modes: ``total_samples``, a run ends at the first step that reaches it;
outer modes: the budget's number of outer steps, each within the step's tolerance), so the final eval loss is at
equal samples (the summary's ``equal_samples``: every mode within 5% of ``sync32``'s ``samples_applied``):

- ``sync32``: exact synchronous rounds in fp32, ``target_batch_size`` T per step;
- ``sync8``: the same with ``compression=8bit`` (blockwise, encoded by sender and reducer, decoded bits everywhere);
- ``outer<H>``: outer (DiLoCo) mode with ``inner_steps=H`` and ``target_batch_size`` H*T, at two values of H;
- ``outer<H>_8bit``: outer mode with 8-bit pseudo-gradients, at the larger H;
- ``outer<H>_8bit_overlap``: the same with ``outer_overlap=true`` (each peer takes the next step's inner steps while
  the outer round communicates: ``node.peer.work.Ahead``);
- ``sync8ef`` and ``outer<H>_8bit_ef`` (only when ``--modes`` names them): ``sync8`` and ``outer<H>_8bit`` with
  ``error_feedback=true`` (each peer carries what its encoding lost into its next contribution);
- ``hivemind``: ``hivemind.Optimizer`` (``_hivemind_peer.py``) with the settings it offers for slow links:
  blockwise 8-bit gradients and state, averaging delayed into the next steps (``delay_grad_averaging``,
  ``delay_optimizer_step``), ``target_batch_size`` T and the same number of epochs as ``sync32`` has steps.

Figures per mode, from the peers' own events and the links' counters, over the steady state (from the first
committed step to the last; start-up and state transfers to joiners are not in it):

- ``bytes_per_sample``: bytes the 4 namespaces sent on their links (everything: tensors, DHT, framing; read
  from the veths' counters when each step was first seen) / the samples committed in that window;
  ``tensor_bytes_per_sample``: the all-reduce's tensor messages alone (the step events' ``sent_bytes``);
- ``utilisation``: per peer, its seconds in forward/backward (the step events' ``compute_s``) / its wall time
  over the window, the mean over peers (4 peers share this machine's cores: a peer waiting for a core is counted
  as computing; ``cores`` says how many there were);
- ``samples_per_second`` over the window; ``eval_loss``: the task's held-out loss after the last step;
- ``same_state_hash``: every committed step has one ``state_hash`` on every peer that reported it; the harness's
  invariants (no block skipped or applied twice, every process cleaned up) are in ``invariants``.

    python benchmarks/links.py --json          # 6 modes, ~20 minutes on 2 cores (needs root: namespaces, tc, nft)
    python benchmarks/links.py --quick --json  # smoke: a tiny model, 2 modes, a few steps

With ``--json`` one ``run`` line per mode and, last, the summary object (``bytes_ratio_outer8``,
``utilisation_outer8``, ``bytes_ratio_sync8``, ``loss_gap_sync8``, ``loss_gap_outer``, ``same_state_hash``, ...);
otherwise a table. Progress goes to stderr. The harness kills every peer's process group and deletes every
namespace at the end of each run, whatever ended it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

sys.path.insert(0, str(HERE))

from _links_hivemind import run_hivemind  # noqa: E402
from simulations.checks import check_all  # noqa: E402
from simulations.runner import Simulation  # noqa: E402
from simulations.trace import parse_trace  # noqa: E402

PEERS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="100mbit", help="every link's cap, both directions (tc tbf syntax)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="one-way delay of every peer's proxy")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=8192, help="the synthetic MLP's width: the gradient's size "
                                                             "(default: 2.1M parameters, 8.4 MB in fp32)")
    p.add_argument("--lr", type=float, default=1e-4, help="the task's AdamW lr (the inner lr in outer mode)")
    p.add_argument("--target-batch-size", type=int, default=3072, help="T: samples per synchronous step")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--h", default="8,32", help="the two inner_steps values of outer mode (8-bit at the larger)")
    p.add_argument("--outer-steps", type=int, default=3, help="outer steps at the larger H: the sample budget")
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--modes", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--matchmaking-time", type=float, default=None,
                   help="seconds a round's group may take to form (default 3.0, --quick 1.0): a join request "
                        "may take half of it, and a join over a 100 ms round trip opens a new stream first")
    p.add_argument("--duration", type=float, default=900.0, help="the most seconds one mode may run")
    p.add_argument("--quick", action="store_true", help="a tiny model, H 2 and 4, 2 outer steps, sync32 and outer8")
    p.add_argument("--workdir", default=None, help="the runs' logs (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.dim, opts.hidden, opts.target_batch_size, opts.batch_size, opts.h, opts.outer_steps = 16, 256, 64, 16, "2,4", 2
        opts.lr = 1e-2
        opts.modes = opts.modes or "sync32,outer8"
    if opts.matchmaking_time is None:
        opts.matchmaking_time = 1.0 if opts.quick else 3.0
    h = [int(x) for x in opts.h.split(",")]
    if len(h) != 2 or min(h) < 1:
        p.error(f"--h takes two positive integers, got {opts.h!r}")
    opts.h_small, opts.h_large = sorted(h)
    return opts


def modes(opts) -> dict[str, dict[str, Any]]:
    """Mode name -> the run's ``--set`` hyperparameters beyond the common ones."""
    t, hs, hl = opts.target_batch_size, opts.h_small, opts.h_large
    outer = dict(outer="diloco", outer_momentum=opts.outer_momentum)
    table = {
        "sync32": dict(target_batch_size=t),
        "sync8": dict(target_batch_size=t, compression="8bit"),
        f"outer{hs}": dict(target_batch_size=hs * t, inner_steps=hs, **outer),
        f"outer{hl}": dict(target_batch_size=hl * t, inner_steps=hl, **outer),
        f"outer{hl}_8bit": dict(target_batch_size=hl * t, inner_steps=hl, compression="8bit", **outer),
        f"outer{hl}_8bit_overlap": dict(target_batch_size=hl * t, inner_steps=hl, compression="8bit",
                                        outer_overlap=True, **outer),
        "hivemind": dict(target_batch_size=t),
        "sync8ef": dict(target_batch_size=t, compression="8bit", error_feedback=True),
        f"outer{hl}_8bit_ef": dict(target_batch_size=hl * t, inner_steps=hl, compression="8bit", error_feedback=True,
                                   **outer),
    }
    opt_in = ("sync8ef", f"outer{hl}_8bit_ef")  # run only when named
    aliases = {"outer8": f"outer{hl}_8bit", "outer": f"outer{hl}", "outer8o": f"outer{hl}_8bit_overlap"}
    if opts.modes:
        wanted = [aliases.get(m, m) for m in opts.modes.split(",") if m]
        unknown = [m for m in wanted if m not in table]
        if unknown:
            raise SystemExit(f"unknown mode(s) {unknown}; known: {sorted(table)} (aliases {sorted(aliases)})")
        return {m: table[m] for m in table if m in wanted}
    return {m: sets for m, sets in table.items() if m not in opt_in}


def trace_for(opts, name: str, sets: dict[str, Any]):
    budget = opts.outer_steps * opts.h_large * opts.target_batch_size
    # the data holds one outer step more than the budget: a run whose last step takes the data epoch's last blocks
    # exactly is another test (outer mode did not finish one on 4 Dec: claims collided at the epoch's end, issue 18)
    examples = budget + opts.h_large * opts.target_batch_size
    # outer modes by their steps: under a sample budget a run ends at the step that reaches it, and an outer step
    # that came out 1.5% short (inside the step's tolerance) took a whole outer step more (7 Dec: 391,752 samples
    # evaluated against sync32's 294,912, not a loss at equal samples)
    size = int(sets["target_batch_size"])
    length = dict(total_steps=-(-budget // size)) if "inner_steps" in sets else dict(total_samples=budget)
    common = dict(dim=opts.dim, hidden=opts.hidden, num_examples=max(4096, examples), eval_every=0, lr=opts.lr,
                  **length)
    return parse_trace(dict(name=f"links-{name}", seed=opts.seed, task="synthetic", sets={**common, **sets},
                            peers=PEERS, min_peers=PEERS, batch_size=opts.batch_size,
                            matchmaking_time=opts.matchmaking_time, duration=opts.duration, links=True,
                            link_rate=opts.rate, latency_ms=opts.latency_ms, events=[]))


class MeteredSimulation(Simulation):
    """The harness's run, reading the links' byte counters when each committed step is first seen."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_at_step: dict[int, tuple[float, int]] = {}  # step -> (runner time, bytes all namespaces sent)

    def _on_event(self, key: str, event: Optional[dict]) -> None:
        super()._on_event(key, event)
        if event and event.get("event") == "step" and event.get("step") not in self.bytes_at_step:
            self.bytes_at_step[int(event["step"])] = (self.now(), sum(self.links.sent_bytes().values()))


def run_mode(opts, name: str, sets: dict[str, Any], logs: Path) -> dict[str, Any]:
    logs.mkdir(parents=True, exist_ok=True)
    if name == "hivemind":
        return dict(run_hivemind(opts, trace_for(opts, name, sets), logs, peers=PEERS, compression="8bit", delay=True),
                    mode=name, sets=dict(sets, compression="8bit", delay=True))

    def emit(kind: str, **fields) -> None:
        if kind in ("sim", "violation", "fault"):
            print(f"  [{name}] {kind}: {fields.get('message', fields)}", file=sys.stderr, flush=True)

    sim = MeteredSimulation(trace_for(opts, name, sets), logs=logs, emit=emit)
    rec = sim.run()
    invariants, why = check_all(rec, cleaned=sim.cleaned, loss_ok=None)
    return dict(mode=name, sets=sets, **figures(rec, sim.bytes_at_step), invariants=invariants,
                problems=why, logs=str(logs))


def figures(rec, bytes_at_step: dict[int, tuple[float, int]]) -> dict[str, Any]:
    """A mode's figures from its record (see the module docstring)."""
    steps = [(t, key, e) for t, key, e in rec.of("step")]
    first: dict[int, dict] = {}
    hashes: dict[int, set] = {}
    for _, _, e in steps:
        first.setdefault(int(e["step"]), e)
        hashes.setdefault(int(e["step"]), set()).add(e["state_hash"])
    if len(first) < 2:
        return dict(steps=len(first), error="fewer than two committed steps")
    s0, s1 = min(first), max(first)
    window = [s for s in first if s0 < s <= s1]
    samples = sum(int(first[s]["samples"]) for s in window)
    (t0, b0), (t1, b1) = bytes_at_step[s0], bytes_at_step[s1]
    tensor_bytes = sum(int(e.get("sent_bytes") or 0) for _, _, e in steps if s0 < int(e["step"]) <= s1)
    evals = [(int(e["step"]), float(e["loss"])) for _, _, e in rec.of("eval") if e.get("loss") is not None]
    cursor = max((e.get("cursor") or {} for _, _, e in steps), key=lambda c: c.get("blocks_applied", 0))
    return dict(steps=len(first), window_steps=len(window), window_samples=samples, window_s=round(t1 - t0, 2),
                samples_per_second=round(samples / max(t1 - t0, 1e-9), 2),
                bytes_per_sample=round((b1 - b0) / max(samples, 1), 1),
                tensor_bytes_per_sample=round(tensor_bytes / max(samples, 1), 1),
                utilisation=utilisation(steps, s0), rounds_abandoned=len(rec.of("round_abandoned")),
                eval_loss=max(evals)[1] if evals else None, eval_step=max(evals)[0] if evals else None,
                samples_applied=cursor.get("samples_applied"), same_state_hash=all(len(h) == 1 for h in hashes.values()),
                mean_group=round(statistics.mean(int(e.get("group", 1)) for _, _, e in steps), 2))


def utilisation(steps: list, s0: int) -> Optional[float]:
    """Mean over peers of (compute seconds after the first committed step) / (wall seconds from it to the peer's
    last step event)."""
    per_peer: dict[str, list] = {}
    for t, key, e in steps:
        per_peer.setdefault(key, []).append((t, int(e["step"]), float(e.get("compute_s") or 0.0)))
    ratios = []
    for rows in per_peer.values():
        rows = [r for r in sorted(rows) if r[1] >= s0]
        if len(rows) < 2:
            continue
        wall = rows[-1][0] - rows[0][0]
        if wall > 0:
            ratios.append(min(1.0, sum(c for _, _, c in rows[1:]) / wall))
    return round(statistics.mean(ratios), 3) if ratios else None


def summarize(runs: dict[str, dict], failed: dict[str, str], opts) -> dict[str, Any]:
    hs, hl = opts.h_small, opts.h_large
    base = runs.get("sync32", {})

    def ratio(mode: str, field: str = "bytes_per_sample") -> Optional[float]:
        a, b = base.get(field), runs.get(mode, {}).get(field)
        return round(a / b, 2) if a and b else None

    def gap(mode: str) -> Optional[float]:
        a, b = base.get("eval_loss"), runs.get(mode, {}).get("eval_loss")
        return round((b - a) / a, 4) if a and b is not None else None

    out: dict[str, Any] = dict(event="summary")
    out.update(bytes_ratio_outer8=ratio(f"outer{hl}_8bit"), utilisation_outer8=runs.get(f"outer{hl}_8bit", {}).get("utilisation"),
               bytes_ratio_sync8=ratio("sync8"), loss_gap_sync8=gap("sync8"), loss_gap_outer=gap(f"outer{hl}"),
               loss_gap_outer_small_h=gap(f"outer{hs}"), loss_gap_outer8=gap(f"outer{hl}_8bit"),
               bytes_ratio_outer8_overlap=ratio(f"outer{hl}_8bit_overlap"),
               utilisation_outer8_overlap=runs.get(f"outer{hl}_8bit_overlap", {}).get("utilisation"),
               loss_gap_outer8_overlap=gap(f"outer{hl}_8bit_overlap"),
               loss_gap_sync8ef=gap("sync8ef"), loss_gap_outer8ef=gap(f"outer{hl}_8bit_ef"),
               # every mode's samples applied within 5% of sync32's: its eval loss is one at equal samples
               equal_samples=bool(base.get("samples_applied")) and all(
                   abs((r.get("samples_applied") or 0) / base["samples_applied"] - 1) <= 0.05 for r in runs.values()),
               tensor_bytes_ratio_outer8=ratio(f"outer{hl}_8bit", "tensor_bytes_per_sample"),
               tensor_bytes_ratio_sync8=ratio("sync8", "tensor_bytes_per_sample"),
               utilisation_sync32=base.get("utilisation"),
               comm_bound_sync32=base.get("utilisation") is not None and base["utilisation"] <= 0.5,
               same_state_hash=bool(runs) and all(r.get("same_state_hash") for m, r in runs.items() if m != "hivemind"),
               invariants_true=bool(runs) and all(all(r.get("invariants", {}).values()) for r in runs.values()),
               bytes_ratio_hivemind=ratio("hivemind"), loss_gap_hivemind=gap("hivemind"), failed=failed, cores=len(os.sched_getaffinity(0)),
               settings=dict(rate=opts.rate, latency_ms=opts.latency_ms, dim=opts.dim, hidden=opts.hidden,
                             target_batch_size=opts.target_batch_size, batch_size=opts.batch_size, h=[hs, hl],
                             outer_steps=opts.outer_steps, outer_momentum=opts.outer_momentum, seed=opts.seed, lr=opts.lr,
                             peers=PEERS, quick=opts.quick))
    return out


def main(argv=None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # the harness cleans up (peers, namespaces) on KeyboardInterrupt
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # 4 peers on a few cores: one torch thread each
    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-links-"))
    runs, failed = {}, {}
    for name, sets in modes(opts).items():
        print(f"{name} ({sets}) ...", file=sys.stderr, flush=True)
        try:
            runs[name] = run_mode(opts, name, sets, workdir / name)
        except Exception as e:  # one mode's failure is reported with the others' figures
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"  failed: {failed[name]}", file=sys.stderr, flush=True)
            continue
        if opts.json:
            print(json.dumps(dict(event="run", **runs[name])), flush=True)
    summary = summarize(runs, failed, opts)
    summary["runs"] = {m: {k: r.get(k) for k in TABLE_FIELDS} for m, r in runs.items()}
    summary["workdir"] = str(workdir)
    print(json.dumps(summary) if opts.json else table(summary), flush=True)
    return 0 if not failed and summary["same_state_hash"] and summary["invariants_true"] else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


TABLE_FIELDS = ("bytes_per_sample", "tensor_bytes_per_sample", "utilisation", "samples_per_second", "eval_loss",
                "samples_applied", "steps", "rounds_abandoned", "same_state_hash")


def table(summary: dict) -> str:
    lines = [f"{'mode':14} " + " ".join(f"{f[:14]:>14}" for f in TABLE_FIELDS)]
    for mode, row in summary["runs"].items():
        lines.append(f"{mode:14} " + " ".join(f"{str(row.get(f)):>14}" for f in TABLE_FIELDS))
    keys = [k for k in summary if k.startswith(("bytes_ratio", "utilisation_", "loss_gap", "same_", "invariants_"))]
    lines += [f"{k}: {summary[k]}" for k in keys]
    if summary["failed"]:
        lines.append(f"failed: {summary['failed']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
