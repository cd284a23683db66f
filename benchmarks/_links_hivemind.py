"""The ``hivemind`` mode of ``links.py``: 4 ``hivemind.Optimizer`` peers (``_hivemind_peer.py``) on the same
namespaces, capped links and delay proxies as the swarmrun modes (``simulations.links.Links``), the same task,
seed and sample budget. Its figures are the swarmrun modes' (bytes read off the links when each epoch is first
seen, ``compute_s`` of the peers' step events, the eval loss of the first peer when it leaves), except
``same_state_hash``: hivemind's peers do not end a round with the same bits, so it is None."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from _common import count_blocks
from _procs import Peer, RunFailed

from simulations.links import Links

STARTUP_TIMEOUT = 120.0


def run_hivemind(opts, trace, logs: Path, *, peers: int, compression: str, delay: bool) -> dict[str, Any]:
    """One run; RunFailed when it cannot start or does not finish within the trace's duration."""
    logs.mkdir(parents=True, exist_ok=True)
    t_zero = time.monotonic()
    links = Links(trace, logs=logs, emit=lambda *a, **k: None, now=lambda: time.monotonic() - t_zero)
    sets = [f"{k}={v}" for k, v in trace.sets.items() if k != "total_samples"]
    target = int(trace.sets["target_batch_size"])
    sets.append(f"total_steps={int(trace.sets['total_samples']) // target}")
    n_blocks = count_blocks("synthetic", dict(s.split("=", 1) for s in sets), trace.seed)
    base = [sys.executable, str(Path(__file__).resolve().parent / "_hivemind_peer.py"), "--run-id", f"links-hm-{trace.seed}",
            "--task", "synthetic", *[x for s in sets for x in ("--set", s)], "--seed", str(trace.seed),
            "--batch-size", str(trace.batch_size), "--matchmaking-time", str(trace.matchmaking_time), "--wait-go",
            "--min-peers", str(peers), "--min-peers-timeout", str(STARTUP_TIMEOUT), "--evaluate",
            "--compression", compression, *(["--delay"] if delay else [])]
    procs: list[Peer] = []
    meter: dict[int, tuple[float, int]] = {}
    try:
        links.open()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        join: list[str] = []
        for i in range(peers):
            prefix, listen = links.attach(f"peer{i}", i)
            if i == 1:  # the first peer's address, once (wait_event takes the event off its queue)
                join = ["--peers", procs[0].wait_event(("listening",), deadline)["maddrs"][0]]
            cmd = [*prefix, *base, *listen, *join, "--start", str(i * n_blocks // peers)]
            procs.append(Peer(f"hivemind-{i}", cmd, logs, stdin_pipe=True))
        for p in procs:
            p.wait_event(("synced",), deadline)
        for p in procs:
            p.send("go\n")
        _follow(procs, links, meter, time.monotonic() + trace.duration)
        link_bytes = links.sent_bytes()
    except RunFailed as e:
        raise RunFailed(f"{e}; " + "; ".join(f"{p.name}: {p.stderr_tail(400)!r}" for p in procs)) from None
    finally:
        for p in procs:
            p.kill()
        links.stop_proxies()
        links.wait_proxies()
        links.close()
    return dict(mode="hivemind" + ("_8bit" if compression == "8bit" else "") + ("_delayed" if delay else ""),
                **figures(procs, meter), link_bytes=link_bytes, logs=str(logs))


def _follow(procs: list[Peer], links: Links, meter: dict, deadline: float) -> None:
    """Until every peer left: read the links' counters when an epoch is first seen."""
    while not all(p.of("left") for p in procs):
        if time.monotonic() > deadline:
            raise RunFailed("the hivemind peers did not finish within the trace's duration")
        for p in procs:
            if any(e.get("event") == "error" for e in p.events):
                raise RunFailed(f"{p.name}: {p.of('error')[-1]}")
            if p.proc.poll() is not None and not p.of("left"):
                raise RunFailed(f"{p.name} exited (rc={p.proc.returncode}) before it left")
            for e in p.of("step"):
                if int(e["step"]) not in meter:
                    meter[int(e["step"])] = (time.monotonic(), sum(links.sent_bytes().values()))
        time.sleep(0.05)


def figures(procs: list[Peer], meter: dict[int, tuple[float, int]]) -> dict[str, Any]:
    steps = [(p.name, e) for p in procs for e in p.of("step")]
    if len(meter) < 2:
        return dict(steps=len(meter), error="fewer than two epochs")
    s0, s1 = min(meter), max(meter)
    samples = sum(int(e["samples_fed"]) for _, e in steps if s0 < int(e["step"]) <= s1)
    (t0, b0), (t1, b1) = meter[s0], meter[s1]
    evals = procs[0].of("eval")
    return dict(steps=s1, window_steps=s1 - s0, window_samples=samples, window_s=round(t1 - t0, 2),
                samples_per_second=round(samples / max(t1 - t0, 1e-9), 2),
                bytes_per_sample=round((b1 - b0) / max(samples, 1), 1), tensor_bytes_per_sample=None,
                utilisation=_utilisation(steps, s0), eval_loss=float(evals[-1]["loss"]) if evals else None,
                samples_applied=sum(int(e["samples_fed"]) for _, e in steps), same_state_hash=None,
                rounds_abandoned=None, invariants={}, problems={})


def _utilisation(steps: list, s0: int) -> Optional[float]:
    per_peer: dict[str, list] = {}
    for name, e in steps:
        per_peer.setdefault(name, []).append((float(e["time"]), int(e["step"]), float(e.get("compute_s") or 0.0)))
    ratios = []
    for rows in per_peer.values():
        rows = [r for r in sorted(rows) if r[1] >= s0]
        if len(rows) >= 2 and rows[-1][0] > rows[0][0]:
            ratios.append(min(1.0, sum(c for _, _, c in rows[1:]) / (rows[-1][0] - rows[0][0])))
    return round(statistics.mean(ratios), 3) if ratios else None
