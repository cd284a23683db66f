"""swarmrun: a deep-learning training run that outlives its machines.

Workers join and leave a DHT-coordinated swarm (built on hivemind), average gradients with an exact,
complete-or-nothing all-reduce, and hold the run's state as hash-verified shards. See ``shared/DESIGN.md``
for the vocabulary: run, spec, task, peer, trainer/keeper, step, state, state_hash, round, manifest,
chunk, provider, snapshot, data cursor, block, coordinator.

Library API (lazy imports; ``import swarmrun`` stays light)::

    task = swarmrun.make_task("my-task", model=..., dataset=..., loss=...)
    swarmrun.train(task, "my-run", create=True)                # first machine
    swarmrun.train(task, "my-run", peers=["/ip4/.../p2p/..."])  # others
"""

__version__ = "0.1.0"
__all__ = ["Task", "ShardedTask", "make_task", "train"]


def __getattr__(name):
    if name in ("make_task", "train"):
        from swarmrun.node import api

        return getattr(api, name)
    if name in ("Task", "ShardedTask"):
        from swarmrun.node.tasks import base as task

        return getattr(task, name)
    raise AttributeError(name)
