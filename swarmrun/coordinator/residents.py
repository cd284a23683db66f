"""Whether a workstation's resident is using it: a small interface and its sources.

- ``script``: by data, for tests and the churn harness: a JSON list of ``[t_seconds, present]`` read from a file;
  the resident is present as the last point at or before the time since the agent started says;
- ``file``: a flag file that ``node agent busy|idle --state-dir DIR`` creates and removes;
- ``idle``: Linux input idle time: the newest modification time of ``/dev/input/event*`` (the kernel touches a
  device node when it delivers an event); present while the last input is younger than ``idle_after`` seconds.
  Machines without readable input devices (servers, containers) read as absent. Load from other users is not
  measured (not done).
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path
from typing import Callable, Protocol

from swarmrun.protocol.errors import UsageError

__all__ = ["Resident", "ScriptResident", "FileResident", "IdleResident", "flag_path", "make_resident"]


class Resident(Protocol):
    """A source of the resident's presence, asked about once a second."""

    def present(self) -> bool: ...


class ScriptResident:
    """Presence by data: ``points`` is a list of (seconds since start, present), in time order."""

    def __init__(self, points: list[tuple[float, bool]], *, clock: Callable[[], float] = time.monotonic) -> None:
        if any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in points):
            raise UsageError("a resident script is a JSON list of [t_seconds, present] pairs")
        self.points = sorted((float(t), bool(v)) for t, v in points)
        self.clock = clock
        self.start = clock()

    def present(self) -> bool:
        elapsed = self.clock() - self.start
        state = False
        for t, value in self.points:
            if t > elapsed:
                break
            state = value
        return state


class FileResident:
    """Present while a flag file exists (``node agent busy`` creates it, ``node agent idle`` removes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def present(self) -> bool:
        return self.path.exists()


class IdleResident:
    """Present while the last input event is younger than ``idle_after`` seconds (Linux ``/dev/input``)."""

    def __init__(self, idle_after: float = 300.0, pattern: str = "/dev/input/event*") -> None:
        self.idle_after, self.pattern = idle_after, pattern

    def present(self) -> bool:
        newest = 0.0
        for node in glob.glob(self.pattern):
            try:
                newest = max(newest, os.stat(node).st_mtime)
            except OSError:
                continue
        return newest > 0 and time.time() - newest < self.idle_after


def flag_path(state_dir: Path) -> Path:
    """The flag file of the ``file`` source in an agent's state dir."""
    return state_dir / "resident-busy"


def make_resident(spec: str, state_dir: Path) -> Resident:
    """The source named by ``--resident``: ``script:FILE``, ``file`` or ``idle[:SECONDS]``. Raises UsageError."""
    kind, _, arg = spec.partition(":")
    if kind == "script":
        try:
            return ScriptResident(json.loads(Path(arg).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--resident script:FILE: cannot read {arg!r}: {e}") from None
    if kind == "file":
        return FileResident(flag_path(state_dir))
    if kind == "idle":
        try:
            return IdleResident(float(arg) if arg else 300.0)
        except ValueError:
            raise UsageError(f"--resident idle[:SECONDS]: bad seconds {arg!r}") from None
    raise UsageError(f"--resident must be script:FILE, file or idle[:SECONDS], got {spec!r}")
