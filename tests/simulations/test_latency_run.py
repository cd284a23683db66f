"""The runner with latency on loopback: every peer behind its delay proxy, announcing the proxy's address.

Real peers (2 live at most, synthetic task, a few steps): the point is that p2pd dials the announced
addresses, so the swarm's connections pass the proxies and none reaches a peer's real port directly
(``latency_applied``), and that the proxies are gone with the run.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm_helpers import process_cmdlines

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

TRACE = {
    "name": "latency-mini", "seed": 3, "task": "synthetic", "sets": {"total_steps": 8, "eval_every": 4},
    "peers": 2, "min_peers": 2, "duration": 200, "latency_ms": 30, "loss_tolerance": 0.5,
    "events": [{"step": 2, "peer": "peer0", "kind": "latency", "ms": 120, "duration": 5}],
}


def test_a_trace_with_latency_runs_every_connection_through_the_proxies(tmp_path):
    trace = tmp_path / "latency-mini.json"
    trace.write_text(json.dumps(TRACE))
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "simulations", "run", str(trace), "--out", str(out), "--json",
                             "--no-baseline"], cwd=ROOT, capture_output=True, text=True, timeout=340)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    summary = lines[-1]
    assert all(summary["invariants"].values()), (summary["invariants"], summary.get("problems"))
    assert summary["invariants"]["latency_applied"] is True
    latency = summary["latency"]
    assert latency["latency_ms"] == 30 and latency["direct_connections"] == [] and latency["scans"] > 0
    assert set(latency["per_peer"]) == {"peer0", "peer1"}
    creator = latency["per_peer"]["peer0"]  # peer1 dialed peer0's announced address: their one connection passed it
    assert creator["connections"] > 0 and creator["bytes_in"] > 0 and creator["bytes_out"] > 0
    assert summary["faults"]["latency"] == 1
    messages = [e["message"] for e in lines if e.get("event") == "sim" and "delay proxy" in e.get("message", "")]
    assert len(messages) == 2  # "peerN: delay proxy HOST:PORT -> HOST:REAL, 30 ms each way"
    proxies = {m.split("delay proxy ")[1].split(" ")[0] for m in messages}
    reals = {m.split(" -> ")[1].split(",")[0] for m in messages}
    for e in map(json.loads, (out / "events.jsonl").read_text().splitlines()):
        if e.get("event") == "listening":  # each peer printed (and so announced) its proxy's address
            host_port = "{}:{}".format(*e["maddrs"][0].split("/")[2:5:2])
            assert host_port in proxies and host_port not in reals, (e["maddrs"], proxies)
    assert result.returncode == 0
    left = [c for c in process_cmdlines() if "simulations.delayproxy" in c and any(f"--to {r}" in c for r in reals)]
    assert not left, left  # the proxies are gone with the run

