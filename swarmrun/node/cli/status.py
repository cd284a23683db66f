"""`node status`: the swarm of a run as it stands (peers, their step, samples/s, role)."""

from __future__ import annotations

import argparse
import asyncio

from swarmrun.node.cli.common import EXIT_CODES, swarm_args
from swarmrun.protocol.errors import RunNotFound
from swarmrun.protocol.history import run_accounting
from swarmrun.protocol.round import SUMMARY_KEYS
from swarmrun.protocol.spec import check_run_id


async def gather_status(run_id: str, initial_peers, *, timeout: float = 8.0) -> dict:
    """Spec and live progress reports of a run, read through a client-mode DHT node.

    Raises:
        RunNotFound: no peer reachable, or the run is unknown to them.
    """
    from hivemind import DHT  # only here: the command's usage errors come before hivemind's import
    from hivemind.utils.timed_storage import get_dht_time

    from swarmrun.node.net.records import anchor_ids, fetch_spec, read_providers, read_view
    from swarmrun.node.net.swarm import run_validators

    try:
        dht = await asyncio.to_thread(DHT, initial_peers=list(initial_peers), start=True, client_mode=True,
                                      record_validators=run_validators(None, [run_id]),
                                      startup_timeout=timeout)
    except Exception as e:
        raise RunNotFound(f"could not reach any of the peers {', '.join(initial_peers)}: {e}") from None
    try:
        signed = await fetch_spec(dht, run_id, timeout=timeout, anchors=anchor_ids(initial_peers))
        if signed is None:
            raise RunNotFound(f"run {run_id!r} was not found at the given peers")
        from swarmrun.node.peer.access import AccessGate

        gate = AccessGate(signed.spec)  # in an invite-only run, reports without a valid certificate are not its peers'
        await gate.refresh(dht)
        view = await read_view(dht, run_id, gate)
        now = get_dht_time()
        peers = [dict(peer_id=p, role=r.role.value, step=r.step, samples=r.samples,
                      samples_per_second=round(r.samples_per_second, 2), state_hash=r.state_hash,
                      age_s=round(max(0.0, now - r.time), 1), finished=r.finished)
                 for p, r in sorted(view.reports.items(), key=lambda kv: (-kv[1].step, kv[0]))]
        spec = signed.spec
        # the run's data accounting, from the cursor of the newest state (None for each key if no peer reports it)
        accounting = run_accounting(view) or {}
        records = await read_providers(dht, run_id, gate)
        providers = [dict(peer_id=p, step=r.step, manifest_hash=r.manifest_hash, state_hash=r.state_hash,
                          mib=round(r.total_bytes / 2**20, 2), keeper=r.keeper, serving=r.serving,
                          step_records=len(r.log), age_s=round(max(0.0, now - r.time), 1))
                     for p, r in sorted(records.items(), key=lambda kv: (-kv[1].step, kv[0]))]
        return dict(providers=providers, run_id=run_id, task=spec.task, spec_hash=spec.spec_hash(), total_steps=spec.total_steps,
                    total_samples=spec.total_samples, samples_applied=accounting.get("samples_applied"),
                    target_batch_size=spec.target_batch_size, step=view.newest_step,
                    samples_per_second=round(sum(p["samples_per_second"] for p in peers if p["role"] == "trainer"), 2),
                    finished=view.finished(), **{k: accounting.get(k) for k in sorted(SUMMARY_KEYS)}, peers=peers)
    finally:
        await asyncio.to_thread(dht.shutdown)


def run_status(args, events) -> int:
    from swarmrun.node.cli.common import require_peers, swarm_config
    from swarmrun.node.runtime import run_async

    check_run_id(args.run_id)
    require_peers(args)
    config = swarm_config(args)
    status = run_async(gather_status(args.run_id, config.initial_peers))
    if events.json_mode:
        events.emit("status", **status)
        return 0
    budget = "" if status.get("total_samples") is None else \
        f" (planned; samples {status['samples_applied']}/{status['total_samples']})"
    events.table(f"run {status['run_id']} ({status['task']}): step {status['step']}/{status['total_steps']}{budget}, "
                 f"{status['samples_per_second']} samples/s{', finished' if status['finished'] else ''}",
                 ("peer", "role", "step", "samples", "samples/s", "state_hash", "age"),
                 [(p["peer_id"][-10:], p["role"], str(p["step"]), str(p["samples"]), str(p["samples_per_second"]),
                   p["state_hash"][:12], f"{p['age_s']}s") for p in status["peers"]])
    if status["providers"]:
        events.table("providers (state that joiners fetch)",
                     ("peer", "step", "state_hash", "MiB", "step records", "serving", "keeper"),
                     [(p["peer_id"][-10:], str(p["step"]), p["state_hash"][:12], str(p["mib"]), str(p["step_records"]),
                       str(p["serving"]), "yes" if p["keeper"] else "") for p in status["providers"]])
    else:
        events.console.print("providers: none announced")
    if status["blocks_applied"] is None:
        events.console.print("data: no peer reports its cursor yet")
    else:
        events.console.print(f"data: epoch {status['data_epoch']}, {status['blocks_applied']} blocks applied, "
                             f"{status['blocks_pending']} pending in this epoch, {status['blocks_skipped']} skipped, "
                             f"{status['blocks_duplicated']} duplicated")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("status", help="the swarm of a run as it stands: peers, steps, samples/s, roles",
                       description="The swarm of a run as it stands: peers, steps, samples/s, roles, providers and "
                                   "the data cursor. It starts a short-lived client node of the swarm (its own "
                                   "p2p daemon, a DHT lookup of the run's records): a few seconds, most of them "
                                   "the daemon's start. Piped, each table is tab-separated lines; --json: one "
                                   "object.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("run_id", metavar="RUN_ID")
    swarm_args(s, listen=False)
    s.add_argument("--json", action="store_true")
