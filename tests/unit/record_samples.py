"""One well-formed record of each kind of ``protocol.records.RUN_KEYS``, as hivemind hands it to a validator
(msgpack subkey and value, the signature stripped). Shared by the record tests and the record fuzz test."""

import msgpack

from swarmrun.protocol.access import Revocations
from swarmrun.protocol.codec import pack
from swarmrun.protocol.records import PLAIN_SUBKEY, RUN_KEYS, SubkeyKind
from swarmrun.protocol.round import ProgressReport, Role, Vote
from swarmrun.protocol.snapshot import Amendment, PauseNote, PauseRecord
from swarmrun.protocol.spec import SignedSpec, Spec
from swarmrun.protocol.transfer import ProviderRecord

RUN = "run-1"
NOW = 1_700_000_000.0
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a base58 peer id
PEER_KEY = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDpeer"
OWNER_KEY = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDowner"


def spec(run_id: str = RUN) -> Spec:
    return Spec(run_id=run_id, task="toy", task_version="1", task_args={"width": 8}, seed=7, data_fingerprint="x",
                hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 16},
                num_examples=1000, owner_key=OWNER_KEY)


def message(kind: str, run_id: str = RUN):
    """The stored object of a good record of ``kind`` (our messages are bytes; hivemind's matchmaking a bool)."""
    amendment = Amendment(step=1, from_spec="a" * 64, to_spec="b" * 64, changes={"lr": 0.2}, time=NOW, signature=b"s")
    return {
        "spec": lambda: SignedSpec(spec=spec(run_id), signature=b"sig").encode(),
        "providers": lambda: ProviderRecord(step=3, manifest_hash="a" * 64, state_hash="b" * 64, total_bytes=10,
                                            time=NOW, log={2: "c" * 64}).encode(),
        "progress": lambda: ProgressReport(step=3, samples=5, samples_per_second=1.5, role=Role.TRAINER,
                                           state_hash="d" * 64, time=NOW).encode(),
        "vote": lambda: Vote(step=3, group_id="ab", grad_hash="cd", ok=True, live=2).encode(),
        "revoked": lambda: Revocations(run_id=run_id, revoked=frozenset({PEER}), issued_at=NOW,
                                       signature=b"s").encode(),
        "pause": lambda: PauseRecord(run_id=run_id, spec_hash="e" * 64, at_step=4, time=NOW, signature=b"s").encode(),
        "paused": lambda: PauseNote(step=4, left=True, where="file:///x@4").encode(),
        "history": lambda: pack([amendment.encode()]),
        "group": lambda: True,
    }[kind]()


def value(kind: str, run_id: str = RUN) -> bytes:
    return msgpack.packb(message(kind, run_id), use_bin_type=True)


def signed_subkey(peer: str = PEER, key: bytes = PEER_KEY) -> bytes:
    return msgpack.packb(peer.encode() + b"[owner:" + key + b"]", use_bin_type=True)


def subkey(kind: str) -> bytes:
    """A subkey of the right kind for ``kind``."""
    return {
        SubkeyKind.NONE: PLAIN_SUBKEY,
        SubkeyKind.PEER: msgpack.packb(PEER, use_bin_type=True),
        SubkeyKind.SIGNED: signed_subkey(),
        SubkeyKind.OWNER: msgpack.packb(b"[owner:" + OWNER_KEY + b"]", use_bin_type=True),
    }[RUN_KEYS[kind].subkey]


def identify(public_key: bytes) -> str:
    """Stands in for ``swarm.peer_id_of``: PEER_KEY is PEER's key."""
    return PEER if public_key == PEER_KEY else "QmStrangerPeer"
