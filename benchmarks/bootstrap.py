"""Bootstrap: a joiner takes a run's whole state (model + Adam moments) from the swarm, swarmrun vs hivemind.

The same state (default: 6 x Linear(2048, 2048) with Adam after one step, ~25.2M parameters, ~302 MB) is taken by
a fresh joiner process, timed from the request until the state is loaded in the joiner's model and optimizer:

- ``hivemind``: ``DecentralizedAverager.load_state_from_peers`` from one donor (``allow_state_sharing=True``,
  ``get_current_state`` returning the live tensors), then loaded with ``RunState.apply``;
- ``swarmrun_k`` (k = 1, 2, 4 providers): the trainer's join path: provider records from the DHT,
  ``choose_state``, ``Fetcher.fetch`` (chunk and tensor digests verified as the chunks arrive), state hash
  checked, ``RunState.apply_frozen(adopt=True)``;
- ``raw_k``: the ceiling of the path itself: raw hivemind P2P binary streams, one per provider, each sending
  its share of the state's bytes in 1 MiB writes (read and dropped).

Every provider is a separate process (its own DHT and p2pd) serving all three at once; provider 0 is also the
hivemind donor. Two networks: ``loopback`` (everything on 127.0.0.1) and ``capped`` (each provider in its own
network namespace, its upload capped by ``tc tbf``, default 100 Mbit/s; the joiner on the host). Runs are
interleaved (hivemind, raw_1, swarmrun_1, raw_2, swarmrun_2, raw_4, swarmrun_4, then again), ``--repeats``
each, medians. MB = 1e6 bytes. A run counts only if the joiner's loaded state hashes to the providers' state.
The swarmrun and raw processes run on ``--loop`` (default uvloop, as ``node`` does); hivemind's averager runs its
own loop in its own process.

    /work/venv/bin/python benchmarks/bootstrap.py [--repeats 3] [--network loopback,capped] [--json]
    /work/venv/bin/python benchmarks/bootstrap.py --quick --repeats 1 --json     # smoke check: tiny model, loopback

With ``--json`` the last stdout line is the summary (``ratio_loopback_4``, ``ceiling_fraction_loopback_4``,
``ratio_capped_4``, ``caps_fraction_capped_4``, all medians and runs); otherwise a table. Every process runs in
its own session and its group is killed when its phase ends; namespaces are removed, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bootstrap_net import CappedNet, NetError  # noqa: E402
from _procs import Peer, RunFailed, kill_all  # noqa: E402

PROVIDER_COUNTS = (1, 2, 4)
NETWORKS = ("loopback", "capped")
FULL = dict(hidden=2048, layers=6)
QUICK = dict(hidden=256, layers=4)
GOALS = dict(ceiling_fraction_loopback_4=0.70, ratio_loopback_4=1.8, caps_fraction_capped_4=0.80)


def schedule() -> list[tuple[str, int]]:
    """One repeat's runs, interleaved: hivemind, then raw and swarmrun for each provider count."""
    return [("hivemind", 1)] + [(mode, k) for k in PROVIDER_COUNTS for mode in ("raw", "swarmrun")]


def system_name(mode: str, k: int) -> str:
    return "hivemind" if mode == "hivemind" else f"{mode}_{k}"


# ---- one network: providers up, the interleaved runs, providers down ----------------------------------------
class Providers:
    """The providers of one network phase (4 processes), started in order: provider 0 first (the DHT's entry
    point and hivemind's donor), then the others joined to it."""

    def __init__(self, opts, network: str, log_dir: Path, net: Optional[CappedNet]):
        self.opts, self.network, self.log_dir, self.net = opts, network, log_dir, net
        self.run_base = f"bench-{uuid.uuid4().hex[:8]}"
        self.peers: list[Peer] = []
        self.ready: list[dict] = []

    def host(self, i: int) -> str:
        return self.net.provider_hosts[i] if self.net else "127.0.0.1"

    def start(self) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout
        n = max(PROVIDER_COUNTS)
        for i in range(n):
            cmd = [*(self.net.prefix(i) if self.net else []), sys.executable, str(HERE / "_bootstrap_provider.py"),
                   "--run-base", self.run_base, "--index", str(i), "--host", self.host(i), "--seed", str(self.opts.seed),
                   "--hidden", str(self.opts.hidden), "--layers", str(self.opts.layers),
                   "--chunk-size", str(self.opts.chunk_size), "--state-dir", str(self.log_dir / f"provider{i}"),
                   "--loop", self.opts.loop,
                   *(["--hivemind"] if i == 0 else [])]
            if i > 0:
                cmd += ["--initial-peers", *self.ready[0]["maddrs"]]
            self.peers.append(Peer(f"{self.network}-provider{i}", cmd, self.log_dir, stdin_pipe=True))
            if i == 0:  # the others need its address
                self.ready.append(self._wait_ready(self.peers[0], deadline))
        self.ready += [self._wait_ready(p, deadline) for p in self.peers[1:]]
        hashes = {(r["manifest_hash"], r["state_hash"]) for r in self.ready}
        if len(hashes) != 1:
            raise RunFailed(f"providers built different states: {sorted(hashes)}")
        self.peers[0].send("donate\n")  # hivemind's donor starts (and declares itself) once the DHT is whole
        self._wait_ready(self.peers[0], deadline, "donating")
        time.sleep(self.opts.settle)  # provider records re-announced once all providers are in the DHT

    def _wait_ready(self, peer: Peer, deadline: float, event: str = "ready") -> dict:
        try:
            return peer.wait_event((event,), deadline)
        except RunFailed as e:
            raise RunFailed(f"{e}; stderr tail: {peer.stderr_tail(800)!r}") from None

    def maddrs(self) -> list[str]:
        return [m for r in self.ready for m in r["maddrs"][:1]]


def start_joiner(opts, providers: Providers, mode: str, k: int, log_dir: Path, name: str) -> Peer:
    first = providers.ready[0]
    cmd = [sys.executable, str(HERE / "_bootstrap_joiner.py"), "--mode", mode, "--k", str(k), "--wait-go",
           "--state-dir", str(log_dir / name),
           "--run-base", providers.run_base, "--providers", *[r["peer_id"] for r in providers.ready],
           "--initial-peers", *providers.maddrs(), "--host", providers.net.joiner_host if providers.net else "127.0.0.1",
           "--hidden", str(opts.hidden), "--layers", str(opts.layers), "--seed", str(opts.seed),
           "--state-hash", first["state_hash"], "--total-bytes", str(first["total_bytes"]),
           "--timeout", str(opts.run_timeout), "--chunk-timeout", str(opts.chunk_timeout), "--loop", opts.loop,
           *(["--window", str(opts.window)] if opts.window else [])]
    return Peer(name, cmd, log_dir, stdin_pipe=True)


def _py_spy() -> str:
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else "py-spy"


def run_joiner(opts, providers: Providers, joiner: Peer, ready_deadline: float, *, profile: bool = False) -> dict[str, Any]:
    """Wait for the joiner to be set up, start its clock with ``go``, collect its result; kill it in any case.
    ``profile``: py-spy records the joiner (and its threads) while it runs, into ``<log dir>/<name>.pyspy``."""
    spy = None
    try:
        # the deadline covers start-up only: a joiner that was ready long ago has its event queued already
        joiner.wait_event(("ready",), max(ready_deadline, time.monotonic() + 10))
        if profile:
            out = joiner.stdout_path.with_suffix(".pyspy")
            spy = subprocess.Popen([_py_spy(), "record", "--pid", str(joiner.proc.pid), "--rate", "200", "--threads",
                                    "--format", "raw", "--output", str(out), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            time.sleep(1.0)  # py-spy attached
        joiner.send("go\n")
        result = joiner.wait_event(("result",), time.monotonic() + opts.run_timeout + 30)
        if not result.get("verified"):
            raise RunFailed(f"{joiner.name}: the loaded state does not verify ({result.get('state_hash', '')[:12]} "
                            f"!= {providers.ready[0]['state_hash'][:12]})")
        return {k: v for k, v in result.items() if k not in ("event", "time", "_received")}
    except RunFailed as e:
        raise RunFailed(f"{e}; stderr tail: {joiner.stderr_tail(800)!r}") from None
    finally:
        joiner.kill()
        if spy is not None:  # py-spy writes its file when the target exits
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(spy.pid, signal.SIGKILL)
                spy.wait()


def run_network(opts, network: str, workdir: Path, runs: list[dict], say) -> dict[str, Any]:
    """All repeats of one network; returns facts about the phase (state size, caps, qdisc counters)."""
    log_dir = workdir / network
    log_dir.mkdir(parents=True, exist_ok=True)
    net = CappedNet(providers=max(PROVIDER_COUNTS), rate_mbit=opts.cap_mbit).open() if network == "capped" else None
    providers = Providers(opts, network, log_dir, net)
    facts: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        providers.start()
        first = providers.ready[0]
        facts.update(state_bytes=first["total_bytes"], chunks=first["chunks"],
                     providers_start_s=round(time.monotonic() - t0, 1))
        say(f"{network}: {len(providers.ready)} providers up in {facts['providers_start_s']}s, state "
            f"{first['total_bytes'] / 1e6:.1f} MB in {first['chunks']} chunks" +
            (f", uploads capped at {opts.cap_mbit:g} Mbit/s each (tc tbf)" if net else ""))
        for rep in range(opts.repeats):
            # the repeat's joiners start together (imports, model, DHT), then run one at a time on "go"
            joiners = [start_joiner(opts, providers, mode, k, log_dir, f"{rep:02d}-{system_name(mode, k)}")
                       for mode, k in schedule()]
            ready_deadline = time.monotonic() + opts.startup_timeout
            for (mode, k), joiner in zip(schedule(), joiners):
                system = system_name(mode, k)
                record: dict[str, Any] = dict(network=network, system=system, repeat=rep)
                t1 = time.monotonic()
                try:
                    record.update(run_joiner(opts, providers, joiner, ready_deadline,
                                             profile=system in opts.profile))
                except RunFailed as e:
                    record.update(mb_per_s=None, error=str(e))
                record["wall_s"] = round(time.monotonic() - t1, 2)
                runs.append(record)
                mbps = record.get("mb_per_s")
                say(f"[{network} {rep + 1}/{opts.repeats}] {system:11s} " + (
                    f"{mbps:8.1f} MB/s  ({record['seconds']:.2f}s" +
                    (f": fetch {record['fetch_s']:.2f} verify {record['verify_s']:.2f} apply {record['apply_s']:.2f}"
                     if mode == "swarmrun" else f": fetch {record['fetch_s']:.2f} apply {record['apply_s']:.2f}"
                     if mode == "hivemind" else "") + ")"
                    if mbps is not None else f"FAILED: {record['error'][:400]}"))
                if opts.json:
                    print(json.dumps(dict(event="run", **record)), flush=True)
        if net:
            facts["qdisc"] = net.qdisc_stats()
        return facts
    finally:
        kill_all()  # this phase's providers and any joiner left (a namespace outlives no process in it)
        providers.peers = []
        if net:
            net.close()


# ---- summary ------------------------------------------------------------------------------------------------
def summarize(opts, runs: list[dict], facts: dict, load: dict) -> dict[str, Any]:
    systems = [system_name(m, k) for m, k in schedule()]
    figures = {net: {s: [r["mb_per_s"] for r in runs if r["network"] == net and r["system"] == s
                         and r.get("mb_per_s") is not None] for s in systems} for net in opts.networks}
    medians = {net: {s: (statistics.median(v) if v else None) for s, v in by.items()} for net, by in figures.items()}

    def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    summary: dict[str, Any] = dict(event="summary")
    cap_mb = opts.cap_mbit * 1e6 / 8 / 1e6  # MB/s per provider
    for net in NETWORKS:
        m = medians.get(net, {})
        for k in PROVIDER_COUNTS:
            summary[f"ratio_{net}_{k}"] = div(m.get(f"swarmrun_{k}"), m.get("hivemind"))
            summary[f"ceiling_fraction_{net}_{k}"] = div(m.get(f"swarmrun_{k}"), m.get(f"raw_{k}"))
            if net == "capped":
                summary[f"caps_fraction_capped_{k}"] = div(m.get(f"swarmrun_{k}"), k * cap_mb)
                summary[f"raw_caps_fraction_capped_{k}"] = div(m.get(f"raw_{k}"), k * cap_mb)
    breakdown = {}
    for net in opts.networks:
        for s in systems:
            rows = [r for r in runs if r["network"] == net and r["system"] == s and r.get("mb_per_s") is not None]
            keys = [key for key in ("seconds", "lookup_s", "fetch_s", "verify_s", "apply_s", "cpu_s", "fetch_mb_per_s")
                    if rows and key in rows[0]]
            if rows:
                breakdown[f"{net}/{s}"] = {key: statistics.median(r[key] for r in rows) for key in keys}
    done = [r for r in runs if r.get("mb_per_s") is not None]
    summary.update(
        goals={key: dict(goal=goal, measured=summary.get(key),
                         met=None if summary.get(key) is None else summary[key] >= goal) for key, goal in GOALS.items()},
        medians_mb_per_s=medians, figures=figures, breakdown_s=breakdown,
        verified_all=bool(done) and all(r.get("verified") for r in done),
        settings=dict(hidden=opts.hidden, layers=opts.layers, quick=opts.quick, repeats=opts.repeats,
                      networks=opts.networks, cap_mbit=opts.cap_mbit, chunk_size=opts.chunk_size,
                      window=opts.window, seed=opts.seed, loop=opts.loop, cpus=os.cpu_count()),
        facts=facts, load=load,
        failed=[dict(network=r["network"], system=r["system"], repeat=r["repeat"], error=r["error"])
                for r in runs if r.get("error")],
        runs=runs,
    )
    return summary


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    st = summary["settings"]
    for net, med in summary["medians_mb_per_s"].items():
        size = summary["facts"].get(net, {}).get("state_bytes")
        table = Table(title=f"bootstrap, {net}: {size / 1e6 if size else 0:.1f} MB state, median of {st['repeats']}"
                            + (f", uploads capped at {st['cap_mbit']:g} Mbit/s" if net == "capped" else ""))
        for col in ("system", "median MB/s", "runs (MB/s)", "vs hivemind", "vs raw same k"):
            table.add_column(col, justify="left" if col == "system" else "right")
        hm = med.get("hivemind")
        for system, value in med.items():
            raw = med.get(system.replace("swarmrun", "raw")) if system.startswith("swarmrun") else None
            table.add_row(system, "-" if value is None else f"{value:.1f}",
                          ", ".join(f"{x:.1f}" for x in summary["figures"][net][system]) or "-",
                          f"{value / hm:.2f}x" if value and hm else "-",
                          f"{value / raw:.0%}" if value and raw else "-")
        console.print(table)
    for key, goal in summary["goals"].items():
        if goal["measured"] is not None:
            console.print(f"{key}: {goal['measured']:.3f} (goal >= {goal['goal']}) {'met' if goal['met'] else 'MISSED'}")
    console.print(f"every loaded state verified: {summary['verified_all']}; load average {summary['load']}")
    for f in summary["failed"]:
        console.print(f"failed {f['network']} {f['system']} #{f['repeat']}: {f['error'][:500]}", markup=False,
                      highlight=False)


# ---- driver -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each system, interleaved (default 3)")
    p.add_argument("--network", default=None,
                   help="comma-separated subset of loopback,capped (default both; loopback with --quick)")
    p.add_argument("--quick", action="store_true", help=f"a tiny model ({QUICK['layers']} x {QUICK['hidden']}): "
                   "a smoke check, not a figure")
    p.add_argument("--hidden", type=int, default=None, help=f"width of each Linear layer (default {FULL['hidden']})")
    p.add_argument("--layers", type=int, default=None, help=f"Linear layers (default {FULL['layers']})")
    p.add_argument("--cap-mbit", type=float, default=100.0, help="each provider's upload cap, Mbit/s (default 100)")
    p.add_argument("--chunk-size", type=int, default=1 << 20, help="manifest chunk size in bytes (default 1 MiB)")
    p.add_argument("--window", type=int, default=None, help="swarmrun Fetcher window (default: Fetcher's own)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of the swarmrun and raw processes, both ends (default uvloop: what node runs on; "
                        "hivemind's averager runs its own)")
    p.add_argument("--seed", type=int, default=20261202)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one joiner may take (default 300)")
    p.add_argument("--chunk-timeout", type=float, default=30.0, help="swarmrun Fetcher chunk_timeout (default 30)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds for the providers (or a repeat's joiners) to be ready (default 300)")
    p.add_argument("--settle", type=float, default=4.0, help="seconds between providers ready and the first run")
    p.add_argument("--profile", default="", metavar="SYSTEMS",
                   help="comma-separated systems (e.g. swarmrun_4,hivemind) whose joiner py-spy records into the "
                        "workdir (<repeat>-<system>.pyspy, collapsed stacks); implies --keep")
    p.add_argument("--workdir", default=None, help="where process logs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp workdir")
    p.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")
    opts = p.parse_args(argv)
    size = QUICK if opts.quick else FULL
    opts.hidden = opts.hidden or size["hidden"]
    opts.layers = opts.layers or size["layers"]
    network = opts.network or ("loopback" if opts.quick else ",".join(NETWORKS))
    opts.networks = [n.strip() for n in network.split(",") if n.strip()]
    opts.profile = [s.strip() for s in opts.profile.split(",") if s.strip()]
    opts.keep = opts.keep or bool(opts.profile)
    bad = [n for n in opts.networks if n not in NETWORKS]
    if bad or not opts.networks or opts.repeats < 1 or opts.hidden < 1 or opts.layers < 1 or opts.cap_mbit <= 0:
        p.error(f"bad --network {bad}" if bad or not opts.networks else
                "--repeats, --hidden, --layers must be >= 1 and --cap-mbit > 0")
    if "capped" in opts.networks and (os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")):
        p.error("--network capped needs root and the ip and tc commands (network namespaces, tc tbf)")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-bootstrap-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    facts: dict[str, Any] = {}
    load = dict(before=[round(x, 2) for x in os.getloadavg()])

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    setup_error = None
    try:
        for network in opts.networks:
            try:
                facts[network] = run_network(opts, network, workdir, runs, say)
            except (RunFailed, NetError) as e:
                setup_error = f"{network}: {e}"
                say(f"{network} phase failed: {e}")
                facts[network] = dict(error=str(e))
    except KeyboardInterrupt:
        say("interrupted: killing peers, removing namespaces")
        kill_all()
        return 130
    finally:
        kill_all()  # run_network already stopped its providers and removed its namespaces; this is the backstop
        failed = setup_error or any(r.get("error") for r in runs)
        if not opts.workdir and not opts.keep and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"process logs kept in {workdir}")
    load["after"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(opts, runs, facts, load)
    if opts.json:
        print(json.dumps(summary), flush=True)
    else:
        print_table(summary)
    every = [summary["medians_mb_per_s"][n][system_name(m, k)] for n in opts.networks for m, k in schedule()]
    return 0 if all(v is not None for v in every) and summary["verified_all"] else 1


if __name__ == "__main__":
    sys.exit(main())
