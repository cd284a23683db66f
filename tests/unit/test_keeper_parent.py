"""A keeper forked just as its coordinator died has no parent-death signal coming: it must not start at all."""

from __future__ import annotations

import os

from swarmrun.coordinator.keepers import _die_with_parent


def _exit_code_of_child(parent: int) -> int:
    pid = os.fork()
    if pid == 0:  # the child: what Popen's preexec_fn runs before exec
        try:
            _die_with_parent(parent)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_keeper_whose_coordinator_already_died_exits_before_exec():
    assert _exit_code_of_child(os.getpid()) == 0  # its parent lives: it goes on (to exec, here to exit 0)
    assert _exit_code_of_child(os.getpid() + 1_000_000) == 1  # the parent it was forked for is not its parent now
