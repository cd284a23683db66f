"""The peer runtime: CLI, swarm setup on hivemind, state capture/apply, the collective round, the trainer loop."""
