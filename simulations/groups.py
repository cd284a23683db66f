"""Process groups the harness started: kill them, wait until they are gone (the runner's, the pool run's and the
tests' clean-up)."""

from __future__ import annotations

import os
import signal
import time


def kill_groups(groups) -> None:
    """SIGKILL each process group (SIGCONT first: a stopped group would not die until continued)."""
    for pgid in groups:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def wait_groups_gone(groups, deadline: float) -> bool:
    """Wait (until the monotonic ``deadline``) for every process group to be gone; whether they all are."""
    while time.monotonic() < deadline and any(group_exists(g) for g in groups):
        time.sleep(0.2)
    return not any(group_exists(g) for g in groups)


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
