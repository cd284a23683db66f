"""swarmrun: a deep-learning training run that outlives its machines.

Workers join and leave a DHT-coordinated swarm (built on hivemind), average gradients with an exact,
complete-or-nothing all-reduce, and hold the run's state as hash-verified shards. See ``shared/DESIGN.md``
for the vocabulary: run, spec, task, peer, trainer/keeper, step, state, state_hash, round, manifest,
chunk, provider, snapshot, data cursor, block, coordinator.
"""

__version__ = "0.1.0"
