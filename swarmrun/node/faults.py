"""Faults injected by data (for tests and the churn harness), never by copies of production code.

``SWARMRUN_FAULTS`` holds ``;``-separated faults ``KIND@POINT:KEY=N``:

- ``kill@allreduce:step=N``: SIGKILL to this peer's whole process group in the middle of the all-reduce (after
  its first part was reduced or sent) of the first round it takes part in at a step >= N;
- ``delay@serve:ms=N``: a provider waits N ms before each chunk of a state it serves (a slow provider; step
  records, the small objects of catch-up, are not delayed);
- ``hold@serve:steps=N``: a provider holds back the last chunk of a state until it has itself stepped N times past
  that state (bounded by the chunk timeout): the swarm moves on while the state travels, by construction;
- ``delay@report:ms=N``: each progress report this peer stores reaches the DHT N ms after it was written (a peer
  whose reports travel slowly: the others plan steps before they read it);
- ``corrupt@serve:step=N``: a provider flips a byte of every chunk it serves of an object at a step >= N (a
  lying provider).

Example: ``SWARMRUN_FAULTS="kill@allreduce:step=3"``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

ENV = "SWARMRUN_FAULTS"
_KINDS = {("kill", "allreduce", "step"), ("delay", "serve", "ms"), ("delay", "report", "ms"),
          ("corrupt", "serve", "step"), ("hold", "serve", "steps")}


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    value: int

    @property
    def step(self) -> int:
        return self.value


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse the fault list; raises ValueError on anything malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        head, _, cond = item.partition(":")
        kind, _, point = head.partition("@")
        key, _, value = cond.partition("=")
        if (kind, point, key) not in _KINDS or not value.isdigit():
            known = ", ".join(f"{k}@{p}:{c}=N" for k, p, c in sorted(_KINDS))
            raise ValueError(f"bad fault {item!r}: expected one of {known}")
        faults.append(Fault(kind, point, int(value)))
    return tuple(faults)


def _planned() -> tuple[Fault, ...]:
    text = os.environ.get(ENV)
    return parse_faults(text) if text else ()


def fire(point: str, step: Optional[int]) -> None:
    """Carry out a kill planned for this point and step, if any."""
    if step is None:
        return
    for fault in _planned():
        if fault.point == point and step >= fault.value and fault.kind == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)


def delay_seconds(point: str) -> float:
    """The planned delay at this point (0 when none)."""
    return sum(f.value for f in _planned() if f.point == point and f.kind == "delay") / 1000


def corrupts(point: str, step: int) -> bool:
    """Whether this peer is planned to corrupt what it sends at this point for an object of ``step``."""
    return any(f.point == point and f.kind == "corrupt" and step >= f.value for f in _planned())


def hold_steps(point: str) -> int:
    """Steps a provider is planned to wait for before it sends the last chunk of a state (0 when none)."""
    return max((f.value for f in _planned() if f.point == point and f.kind == "hold"), default=0)
