"""`node join --spec FILE`: a new run created from a spec its owner signed elsewhere (a pool's coordinator holds the
owner key; the peer that starts the run holds only a certificate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrun.node.net.swarm import SwarmConfig, new_key, public_key_bytes
from swarmrun.node.peer.build import make_spec
from swarmrun.node.peer.join import JoinOptions, _check_options, read_spec_file
from swarmrun.node.tasks.base import load_task_class
from swarmrun.protocol.errors import IncompatibleState, UsageError
from swarmrun.protocol.spec import SignedSpec


def _signed(key, run_id="r") -> SignedSpec:
    spec, _ = make_spec(run_id=run_id, task_cls=load_task_class("synthetic"), sets={}, seed=1,
                        owner_key=public_key_bytes(key), access="invite")
    return SignedSpec.sign(spec, key.sign)


def test_a_spec_file_is_read_and_verified(tmp_path: Path):
    owner = new_key()
    path = tmp_path / "spec"
    path.write_bytes(_signed(owner).encode())
    signed = read_spec_file(str(path), "r")
    assert signed.spec.owner_key == public_key_bytes(owner) and signed.spec.access == "invite"
    with pytest.raises(IncompatibleState):
        read_spec_file(str(path), "other")  # another run's spec
    forged = _signed(owner)
    path.write_bytes(SignedSpec(spec=forged.spec, signature=new_key().sign(forged.spec.unsigned_bytes())).encode())
    with pytest.raises(IncompatibleState):
        read_spec_file(str(path), "r")  # not signed by the owner it names
    path.write_bytes(b"not a spec")
    with pytest.raises(UsageError):
        read_spec_file(str(path), "r")
    with pytest.raises(UsageError):
        read_spec_file(str(tmp_path / "missing"), "r")


def test_spec_creates_a_run_like_task_and_excludes_it(tmp_path: Path):
    swarm = SwarmConfig(state_dir=tmp_path)
    _check_options(JoinOptions(run_id="r", spec="f", swarm=swarm))  # no --peers needed: it creates the run
    for bad in (dict(task="synthetic"), dict(resume_from="store"), dict(access="invite"), dict(sets={"lr": "1"})):
        with pytest.raises(UsageError):
            _check_options(JoinOptions(run_id="r", spec="f", swarm=swarm, **bad))
