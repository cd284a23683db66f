"""A trainer's knobs (``TrainerConfig``), apart from the trainer so that the parts it is made of can name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swarmrun.protocol.round import Role

__all__ = ["TrainerConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Knobs of a trainer. Timeouts work on loopback and on a WAN; all are seconds."""

    batch_size: int = 16
    device: str = "cpu"
    max_steps: Optional[int] = None  # leave once the run reaches this step
    role: Role = Role.TRAINER
    report_interval: float = 0.5
    report_ttl: float = 8.0  # a peer whose report is older is not live
    matchmaking_time: float = 2.0
    request_timeout: float = 1.0
    averaging_timeout: float = 30.0  # matchmaking + all-reduce, per round
    allreduce_timeout: float = 20.0
    next_chunk_timeout: float = 4.0  # a silent peer is dropped from an all-reduce after this
    vote_timeout: float = 6.0
    state_timeout: float = 60.0
    mixed_precision: bool = True  # autocast to bf16 on CUDA
    max_failed_rounds: int = 50  # consecutive abandoned rounds before giving up
    # do not step until this many trainers are live (a demo or test waiting for its peers); once they were, the run
    # goes on with fewer, but never steps alone while fewer than this are live
    min_peers: int = 1
    # a trainer that saw others vanish without saying they left (a crash or a partition: the same from inside) waits
    alone_after: float = 60.0  # this long before it steps alone (and those steps hold no anchor: ``protocol.history``)
    finish_linger: float = 45.0  # a finished peer serves trainers still behind at most this long (> a round's wait)
