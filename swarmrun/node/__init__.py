"""The peer runtime, in layers that import one way only (``tests/unit/test_layers.py`` holds it):

- ``cli/``: the `node` command, one module per command group; ``api.py``: the library entry points;
- ``peer/``: one peer of a run: join, trainer, catch-up, the round's averager, access gate, snapshots side;
- ``net/``: hivemind setup (identity, DHT), every DHT record of a run (``net/records.py``), serving and fetching
  states;
- ``state/``: the run state and its frozen copy, the snapshot store, step records; ``tasks/``: the task API and
  the built-in tasks;
- ``output.py``, ``faults.py``, ``runtime.py``: events and logs, faults by data, the asyncio helpers.

Code outside ``swarmrun.node`` (simulations, benchmarks, the coordinator) imports only the names below, from
``swarmrun.node`` itself. They load lazily: ``import swarmrun.node`` imports neither torch nor hivemind.
"""

from importlib import import_module

_EXPORTS = {
    # tasks and the run state
    "Task": "tasks.base", "ShardedTask": "tasks.base", "batch_len": "tasks.base", "coerce_args": "tasks.base",
    "load_task_class": "tasks.base", "available_tasks": "tasks.base", "RunState": "state.run",
    "FrozenState": "state.run", "SnapshotStore": "state.store",
    # building and running a peer
    "make_spec": "peer.build", "initial_state": "peer.build",
    "DEFAULT_SEED": "peer.build", "TrainerConfig": "peer.trainer", "JoinOptions": "peer.join",
    "run_peer": "peer.join",
    # the swarm and its records
    "SwarmConfig": "net.swarm", "start_dht": "net.swarm", "ensure_identity": "net.swarm",
    "public_key_bytes": "net.swarm", "record_validator": "net.swarm", "run_validators": "net.swarm", "signed_subkey": "net.swarm",
    "kill_descendants": "runtime", "read_view": "net.records", "read_providers": "net.records",
    "fetch_spec": "net.records", "owner_session": "net.records",
    # owning runs from elsewhere (the pool's coordinator holds one owner key per run)
    "new_key": "net.swarm", "key_bytes": "net.swarm", "load_key": "net.swarm", "hold_owner_keys": "net.swarm",
    "peer_id_of": "net.swarm", "verify_signature": "net.swarm", "publish_revocations": "net.records",
    "watch_runs": "net.validator", "certificate_text": "peer.access",
    # state transfer
    "StateServer": "net.serve", "admit_open": "net.serve", "Fetcher": "net.fetch", "FetchFailed": "net.fetch",
    # peers as processes (tests, the demo, the churn harness, the pool's agent)
    "build_parser": "cli.main", "PeerProcess": "cli.demo", "start_peer": "cli.demo", "Events": "output", "run_async": "runtime",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'swarmrun.node' has no attribute {name!r}")
    value = getattr(import_module(f"swarmrun.node.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
