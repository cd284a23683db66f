"""swarmrun's sans-IO protocol: messages, state format, data cursor and errors.

Imports only the stdlib, msgpack, blake3 (chunk hashes) and numpy (the step plan's block masks): no sockets, no
asyncio, no torch.

Glossary (shared/DESIGN.md; the code uses these words and no synonyms):

- run: a training job with an identity ``run_id``, a spec and a state that
  outlives any machine.
- spec: the immutable description of a run (task and version, task arguments,
  hyperparameters incl. ``target_batch_size`` and block size, seed, owner's
  public key, access policy). Signed by the owner; its hash is part of every state.
- task: installed Python code (entry-point group ``swarmrun.tasks``) that builds
  model, optimizer, scheduler, dataset and loss from a spec. Never loaded from
  the network.
- peer: one ``node`` process: one identity (RSA key), one hivemind DHT + P2P.
- trainer / keeper: a peer that trains / a peer that only holds and serves state.
- step: one optimizer update of the run, taken when the swarm together has
  processed ``target_batch_size`` samples (hivemind calls it epoch).
- state: at step s, params, optimizer, scheduler, step, data cursor, RNG state
  and the unsigned-spec hash. Logical: independent of device and layout.
- state_hash: the hash of a state's training content, independent of chunking,
  signatures and writer (``Manifest.state_hash``).
- round: one attempt at a collective step (matchmaking, all-reduce, commit
  vote); it commits for every participant or is abandoned by all.
- manifest: the index of a state: tensors, chunk hashes and small metadata
  (msgpack). Its hash is the state's identity (``Manifest.manifest_hash``).
- chunk: a fixed-size byte range of a serialized state; the unit of transfer
  and verification.
- provider: a peer that serves chunks of a manifest it holds.
- snapshot: a manifest and its chunks in durable storage, written atomically.
- data cursor: the run's position in its data order: data epoch, permutation
  seed, the blocks already applied (``DataCursor``).
- block: a fixed run of consecutive examples in the data order, sized by the
  spec; the unit of data accounting.
- coordinator: the optional service that pools machines across runs.
- outer step / inner step / pseudo-gradient (outer mode, ``protocol.outer``): a
  committed step of a run in outer mode is an outer step; between two, each
  trainer takes inner steps (the task's optimizer) on its own copy of the
  model; a round averages pseudo-gradients (committed minus local parameters).
"""

from swarmrun.protocol.codec import canonical_hash, pack, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet, block_examples, block_order, num_blocks
from swarmrun.protocol.errors import (
    AccessRefused,
    IncompatibleState,
    LocalProtocolError,
    ProtocolError,
    Reject,
    Rejection,
    RemoteProtocolError,
    RunNotFound,
    SwarmrunError,
    UsageError,
)
from swarmrun.protocol.manifest import Manifest, TensorEntry, build_manifest
from swarmrun.protocol.spec import SignedSpec, Spec, amend

__all__ = [
    "AccessRefused", "DataCursor", "IncompatibleState", "LocalProtocolError", "Manifest", "ProtocolError",
    "RangeSet", "Reject", "Rejection", "RemoteProtocolError", "RunNotFound", "SignedSpec", "Spec",
    "SwarmrunError", "TensorEntry", "UsageError", "amend", "block_examples", "block_order",
    "build_manifest", "canonical_hash", "num_blocks", "pack", "unpack",
]
