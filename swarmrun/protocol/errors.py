"""All errors of swarmrun, and the reasons a peer refuses a request.

Each error class carries the process ``exit_code`` that the CLI uses when the
error reaches it. Protocol errors follow h11: ``LocalProtocolError`` when we were
about to send something invalid, ``RemoteProtocolError`` when bytes from a peer
were malformed, oversized or invalid.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "SwarmrunError",
    "UsageError",
    "RunNotFound",
    "CatchUpFailed",
    "AccessRefused",
    "IncompatibleState",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "Reject",
    "Rejection",
]


class SwarmrunError(Exception):
    """Base class of every error swarmrun raises on purpose."""

    exit_code = 1


class UsageError(SwarmrunError):
    """The user asked for something invalid (bad flag, forbidden amendment, ...)."""

    exit_code = 2


class RunNotFound(SwarmrunError):
    """No spec, provider or snapshot could be found for the run."""

    exit_code = 3


class CatchUpFailed(SwarmrunError):
    """A joiner could not get a verified state of the swarm in time, though the run exists (its providers went away,
    replaced what they announced faster than it could be fetched, or could not be reached): not a corrupt or
    incompatible state."""

    exit_code = 3


class RoundsFailed(SwarmrunError):
    """This peer's rounds were abandoned ``max_failed_rounds`` times in a row: no group with the run's other peers
    formed or committed (they could not be reached, or stepped faster than this peer could join): not a corrupt or
    incompatible state (issue 14: a fast swarm's joiner that gave up left with exit 5)."""

    exit_code = 3


class AccessRefused(SwarmrunError):
    """The run's access policy does not admit this peer."""

    exit_code = 4


class IncompatibleState(SwarmrunError):
    """A state, spec or snapshot is incompatible with this run, or corrupt."""

    exit_code = 5


class ProtocolError(SwarmrunError):
    """A message violates the protocol."""

    exit_code = 5


class LocalProtocolError(ProtocolError):
    """We were about to send something invalid (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """Bytes received from a peer were malformed, oversized or invalid."""


class Conflict(UsageError):
    """A request clashes with the pool registry's state: a run id taken, a worker already assigned, an action the
    run's state does not allow."""


class WorkerNotFound(SwarmrunError):
    """No pool worker with this id is registered (an agent answers by registering again)."""

    exit_code = 3


class TaskError(ValueError):
    """A task cannot be built from the given arguments (bad value, missing corpus, ...). Raised by task code;
    the peer turns it into a ``UsageError`` (a new run) or an ``IncompatibleState`` (a run's spec)."""


class Stopped(Exception):
    """A stop was requested while the trainer waited on the swarm (not an error: the trainer leaves)."""


class Reject(enum.Enum):
    """Reasons a peer refuses another peer's request."""

    MALFORMED = "malformed"
    WRONG_SPEC = "wrong_spec"
    WRONG_STEP = "wrong_step"
    NOT_ADMITTED = "not_admitted"
    BUSY = "busy"
    UNKNOWN_STATE = "unknown_state"
    # a DHT record under a run's key that breaks the run's schema table (``protocol.records``)
    PLAIN_VALUE = "plain_value"  # a plain value where the schema says subkeys
    UNEXPECTED_SUBKEY = "unexpected_subkey"  # a subkey where the schema says a plain value
    UNSIGNED = "unsigned"  # a subkey that is not signed (or not by whom it must be) where the schema says signed
    EXPIRATION = "expiration"  # an expiration that is not finite or lies further ahead than the key's TTL
    TOO_LARGE = "too_large"  # a value or subkey over the key's size bound
    WRONG_RUN = "wrong_run"  # a record that names another run than its key


@dataclass(frozen=True)
class Rejection:
    """A refusal: the reason and a human-readable detail."""

    reason: Reject
    detail: str = ""

    def __str__(self) -> str:
        if self.detail:
            return f"{self.reason.value}: {self.detail}"
        return self.reason.value
