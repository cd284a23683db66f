"""The pool's records as placement reads them, placement's actions, and ``apply``, which records actions.

A pool run, a worker (a workstation as its agent last reported it), an assignment (a worker given to
a run), the placement policy; and the four actions ``plan`` returns: ``Assign``, ``Release``,
``Pause``, ``Resume``, each with a human reason. ``apply`` is the one reading of those actions, shared
by the tests and the coordinator's registry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence, Union

from swarmrun.protocol.errors import UsageError


class RunState(str, enum.Enum):
    """Where a pool run stands. Only a running run holds workers."""

    PENDING = "pending"      # submitted, never started
    RUNNING = "running"
    PAUSED = "paused"        # by placement (below its min_peers); resumes when capacity returns
    HELD = "held"            # by its owner (``node hold``); placement never resumes it
    FINISHED = "finished"
    CANCELLED = "cancelled"


ACTIVE = (RunState.PENDING, RunState.RUNNING, RunState.PAUSED)


@dataclass(frozen=True, kw_only=True)
class Needs:
    """What a worker must have for a run: a device kind and at least ``min_memory`` bytes of it."""

    device: str = "cpu"  # "cpu" or "cuda"
    min_memory: int = 0  # of that device: RAM for "cpu", memory per GPU for "cuda"


@dataclass(frozen=True, kw_only=True)
class PoolRun:
    """A run of the pool as placement sees it (the registry holds the rest: task, owner key, ...)."""

    run_id: str
    owner: str
    min_peers: int
    max_peers: int
    submitted_at: float
    priority: int = 1  # higher first; the CLI names 0, 1, 2 low, normal, high
    share: float = 1.0  # weight of its fair share inside its priority class
    needs: Needs = field(default_factory=Needs)
    state: RunState = RunState.PENDING

    def __post_init__(self) -> None:
        if not 1 <= self.min_peers <= self.max_peers:
            raise UsageError(f"run {self.run_id}: need 1 <= min_peers <= max_peers, "
                             f"got {self.min_peers} and {self.max_peers}")
        if not self.share > 0:
            raise UsageError(f"run {self.run_id}: share must be positive, got {self.share}")


@dataclass(frozen=True, kw_only=True)
class Worker:
    """A workstation as the pool sees it, from its agent's last report.

    ``devices`` maps each device kind to its memory in bytes ({"cpu": RAM, "cuda": memory per GPU}).
    """

    worker_id: str
    devices: Mapping[str, int]
    last_seen: float
    resident_present: bool = False


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """A worker given to a run since ``since`` (the clock of ``plan``)."""

    worker_id: str
    run_id: str
    since: float


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Placement's knobs. The defaults suit a lab of workstations whose peers take minutes to sync."""

    min_residence_s: float = 120.0  # an assignment this young is not preempted nor rebalanced
    hysteresis: float = 0.5  # weighted-share gap a rebalancing move must exceed, in workers per unit share
    worker_timeout: float = 30.0  # a worker not heard from for longer is dead

    def __post_init__(self) -> None:
        if self.min_residence_s < 0 or self.hysteresis < 0 or self.worker_timeout <= 0:
            raise UsageError(f"invalid placement policy {self}")


@dataclass(frozen=True, kw_only=True)
class Assign:
    """Give a worker to a running run: its agent starts a peer that joins the run."""

    worker_id: str
    run_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Release:
    """End an assignment: the worker's peer leaves the run gracefully (the swarm continues)."""

    worker_id: str
    run_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Pause:
    """Stop a running run to a snapshot (never kill it); the releases of its workers follow this action."""

    run_id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Resume:
    """A pending run starts, or a paused one resumes; its assignments follow this action."""

    run_id: str
    reason: str


Action = Union[Assign, Release, Pause, Resume]


def fits(run: PoolRun, worker: Worker) -> bool:
    """Whether ``worker`` has the device kind and memory ``run`` needs."""
    return worker.devices.get(run.needs.device, -1) >= run.needs.min_memory


def usable(worker: Worker, now: float, policy: Policy) -> bool:
    """Whether a worker may be lent: heard from lately and its resident away."""
    return not worker.resident_present and now - worker.last_seen <= policy.worker_timeout


def apply(actions: Iterable[Action], runs: Sequence[PoolRun], assignments: Sequence[Assignment],
          now: float) -> tuple[tuple[PoolRun, ...], tuple[Assignment, ...]]:
    """The registry after ``actions``: runs with their new states, and the assignments (new ones since ``now``).

    Pure bookkeeping, shared by the tests and the coordinator, so both read plan's actions one way.

    Raises:
        ValueError: an action that does not fit the state (assigning a busy worker, releasing an
            assignment that does not exist, pausing a run that is not running, ...), or a result in which
            a run that is not running holds a worker.
    """
    by_id = {r.run_id: r for r in runs}
    held = {a.worker_id: a for a in assignments}
    for act in actions:
        if isinstance(act, Release):
            if act.worker_id not in held or held[act.worker_id].run_id != act.run_id:
                raise ValueError(f"release of {act.worker_id} from {act.run_id}: no such assignment")
            del held[act.worker_id]
        elif isinstance(act, Assign):
            if act.worker_id in held or act.run_id not in by_id:
                raise ValueError(f"assign {act.worker_id} to {act.run_id}: worker busy or run unknown")
            held[act.worker_id] = Assignment(worker_id=act.worker_id, run_id=act.run_id, since=now)
        else:
            _apply_state(act, by_id)
    for a in held.values():
        if a.run_id not in by_id or by_id[a.run_id].state is not RunState.RUNNING:
            raise ValueError(f"worker {a.worker_id} left with run {a.run_id}, which is not running")
    return tuple(by_id[r.run_id] for r in runs), tuple(held.values())


def _apply_state(act: Union[Pause, Resume], by_id: dict[str, PoolRun]) -> None:
    run = by_id.get(act.run_id)
    allowed = (RunState.RUNNING,) if isinstance(act, Pause) else (RunState.PENDING, RunState.PAUSED)
    if run is None or run.state not in allowed:
        raise ValueError(f"{type(act).__name__} of run {act.run_id} in state {run and run.state}")
    by_id[act.run_id] = replace(run, state=RunState.PAUSED if isinstance(act, Pause) else RunState.RUNNING)
