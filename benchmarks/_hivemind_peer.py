"""One peer of the plain ``hivemind.Optimizer`` baseline (started by step_throughput.py in its own session).

Builds the same task, model, optimizer and schedule as ``node join`` and trains with ``hivemind.Optimizer`` under
swarmrun's timeouts. JSON lines on stdout: ``listening`` (maddrs), ``ready``, one ``step`` per epoch change
(``step`` = the new epoch, ``time`` = wall clock, ``samples_fed`` = the samples this peer passed to ``opt.step``
since its previous epoch change), ``left``. It waits until hivemind's progress tracker sees
``--min-peers`` peers (``synced``); with ``--wait-go`` it then trains only after reading a line from stdin, so both
peers start together.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import torch

from _common import batch_len, batches, build_model_and_optimizer, build_task, emit, parse_sets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--run-id", required=True)
    p.add_argument("--task", default="synthetic")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--matchmaking-time", type=float, required=True)
    p.add_argument("--peers", nargs="*", default=[])
    p.add_argument("--start", type=int, default=0, help="position in the block order where this peer starts")
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--min-peers", type=int, default=2, help="wait until the tracker sees this many peers")
    p.add_argument("--min-peers-timeout", type=float, default=60.0)
    p.add_argument("--verbose", action="store_true", help="hivemind.Optimizer(verbose=True): its status on stderr")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="the DHT's host multiaddr")
    p.add_argument("--announce", default=None, help="the multiaddr others dial (e.g. a delay proxy's)")
    p.add_argument("--compression", choices=("none", "fp16", "8bit"), default="none",
                   help="grad_compression and state_averaging_compression")
    p.add_argument("--delay", action="store_true",
                   help="delay_grad_averaging and delay_optimizer_step: average in the background of the next steps")
    p.add_argument("--evaluate", action="store_true", help="emit the task's eval loss when the peer leaves")
    return p.parse_args()


def wait_for_peers(opt, min_peers: int, timeout: float) -> bool:
    """Wait until hivemind's progress tracker sees ``min_peers`` peers (emits ``error`` and returns False after
    ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while opt.tracker.global_progress.num_peers < min_peers:
        if time.monotonic() > deadline:
            emit("error", message=f"tracker saw {opt.tracker.global_progress.num_peers} peer(s) after "
                                  f"{timeout}s, wanted {min_peers}")
            return False
        time.sleep(0.1)
    return True


def optimizer_options(args) -> dict:
    """hivemind.Optimizer's options for slow links: compression of gradients and state, averaging delayed."""
    from hivemind import compression

    codec = {"none": compression.NoCompression, "fp16": compression.Float16Compression,
             "8bit": compression.BlockwiseQuantization}[args.compression]()
    options = dict(grad_compression=codec, state_averaging_compression=codec)
    if args.delay:
        options.update(delay_grad_averaging=True, delay_optimizer_step=True)
    return options


def start_optimizer(args, target: int, optimizer, scheduler, rebuild=None):
    """The DHT (its ``listening`` event emitted) and hivemind.Optimizer under swarmrun's timeouts.

    ``rebuild``: ``(optimizer_factory, scheduler_factory)``; delayed updates (``--delay``) need hivemind.Optimizer to
    build the optimizer itself, on its own copy of the parameters (``params=...``, ``optimizer=lambda params: ...``)."""
    import hivemind
    from swarmrun.node import TrainerConfig

    cfg = TrainerConfig()  # swarmrun's defaults: the same timeouts as `node join`
    dht = hivemind.DHT(start=True, initial_peers=args.peers or None, host_maddrs=[args.listen],
                       announce_maddrs=[args.announce] if args.announce else None)
    emit("listening", maddrs=[str(m) for m in dht.get_visible_maddrs()])
    built = dict(optimizer=optimizer, scheduler=scheduler)
    if args.delay and rebuild is not None:
        params = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]  # groups kept
        built = dict(params=params, optimizer=rebuild[0], scheduler=rebuild[1])
    opt = hivemind.Optimizer(dht=dht, run_id=args.run_id, target_batch_size=target, batch_size_per_step=args.batch_size,
                             **built, matchmaking_time=args.matchmaking_time,
                             averaging_timeout=cfg.averaging_timeout, allreduce_timeout=cfg.allreduce_timeout,
                             next_chunk_timeout=cfg.next_chunk_timeout, load_state_timeout=cfg.state_timeout,
                             averager_opts=dict(request_timeout=cfg.request_timeout), use_local_updates=False,
                             shutdown_timeout=3.0, verbose=args.verbose, **optimizer_options(args))
    return dht, opt


def main() -> int:
    args = parse_args()

    task, hparams = build_task(args.task, parse_sets(args.sets), args.seed)
    total_steps, target = int(hparams["total_steps"]), int(hparams["target_batch_size"])
    model, optimizer, scheduler = build_model_and_optimizer(task, hparams, args.seed)

    accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold more (AdamW's decoupled_...)
    options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    rebuild = (lambda params: type(optimizer)(params, **options), lambda opt: task.build_scheduler(opt, hparams))
    dht, opt = start_optimizer(args, target, optimizer, scheduler, rebuild)
    emit("ready", epoch=opt.local_epoch)
    model.train()
    data = batches(task, hparams, args.seed, args.batch_size, start=args.start)
    epoch = opt.local_epoch

    fed = [0]  # samples this peer fed to hivemind.Optimizer since its last epoch change
    computing = [0.0]  # seconds in forward and backward since the last epoch change

    def train_on(batch) -> float:
        t0 = time.perf_counter()
        loss = task.loss(model, batch)
        loss.backward()
        computing[0] += time.perf_counter() - t0
        fed[0] += batch_len(batch)
        opt.step(batch_size=batch_len(batch))
        opt.zero_grad()
        return float(loss.detach())

    try:
        # like `node join --min-peers 2`: hivemind's progress tracker publishes a peer only once it has accumulated
        # samples, and a peer that sees no others steps alone ("there are no other peers"). So: one batch, then
        # wait until the tracker sees the other peer(s), then (with --wait-go) wait for the common start.
        train_on(next(data))
        if not wait_for_peers(opt, args.min_peers, args.min_peers_timeout):
            return 3
        emit("synced", peers=opt.tracker.global_progress.num_peers, epoch=opt.local_epoch)
        if args.wait_go:
            sys.stdin.readline()
        for batch in data:
            if opt.local_epoch >= total_steps:
                break
            loss = train_on(batch)
            if opt.local_epoch != epoch:
                emit("step", step=opt.local_epoch, jumped=opt.local_epoch - epoch - 1, loss=loss, samples_fed=fed[0],
                     compute_s=round(computing[0], 4))
                epoch, fed[0], computing[0] = opt.local_epoch, 0, 0.0
        if args.evaluate:
            emit("eval", step=opt.local_epoch, loss=task.evaluate(model, torch.device("cpu")))
        emit("left", step=opt.local_epoch)
    finally:
        t0 = time.monotonic()
        try:
            opt.shutdown()
        finally:
            dht.shutdown()
        emit("shutdown", seconds=round(time.monotonic() - t0, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
