"""Faults injected by data (for tests and the churn harness), never by copies of production code.

``SWARMRUN_FAULTS`` holds ``;``-separated faults ``KIND@POINT:step=N``; the only kind so far is ``kill``
(SIGKILL to this peer's whole process group), at the point ``allreduce`` (after this peer's first part
was reduced, i.e. in the middle of the all-reduce) of the first round it takes part in at a step >= N. Example: ``SWARMRUN_FAULTS="kill@allreduce:step=3"``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

ENV = "SWARMRUN_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    step: int


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse the fault list; raises ValueError on anything malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        head, _, cond = item.partition(":")
        kind, _, point = head.partition("@")
        key, _, value = cond.partition("=")
        if kind != "kill" or point != "allreduce" or key != "step" or not value.isdigit():
            raise ValueError(f"bad fault {item!r}: expected kill@allreduce:step=N")
        faults.append(Fault(kind, point, int(value)))
    return tuple(faults)


def fire(point: str, step: Optional[int]) -> None:
    """Carry out a fault planned for this point and step, if any."""
    text = os.environ.get(ENV)
    if not text or step is None:
        return
    for fault in parse_faults(text):
        if fault.point == point and step >= fault.step and fault.kind == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
