"""The runs this state dir owns: the signed spec of each run its key created (or resumed), kept at
``STATE_DIR/runs/RUN_ID.spec`` so owner commands that work offline (``node invite``) can tell, before they sign
anything, that this key is the run's owner."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from swarmrun.protocol.errors import ProtocolError
from swarmrun.protocol.spec import SignedSpec, check_run_id


def owned_path(state_dir: Path, run_id: str) -> Path:
    return Path(state_dir) / "runs" / f"{check_run_id(run_id)}.spec"


def remember_owned(state_dir: Path, signed: SignedSpec) -> None:
    """Keep the signed spec of a run this state dir's key owns (atomically; a failure only costs the shortcut)."""
    path = owned_path(state_dir, signed.spec.run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(signed.encode())
        os.replace(tmp, path)
    except OSError:
        pass


def owned_spec(state_dir: Path, run_id: str) -> Optional[SignedSpec]:
    """The run's signed spec if this state dir created or resumed it, else None (also for a corrupt file)."""
    try:
        return SignedSpec.decode(owned_path(state_dir, run_id).read_bytes())
    except (OSError, ProtocolError):
        return None
