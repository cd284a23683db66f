"""A small blocking client of the coordinator's HTTP API (stdlib urllib: no dependency), for the CLI and the agent.

Answers map to the CLI's errors and exit codes: unreachable or 404 -> RunNotFound (3), 401/403 -> AccessRefused
(4), 409/422/400 -> UsageError (2); anything else -> SwarmrunError (1).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, Optional

from swarmrun.protocol.errors import AccessRefused, RunNotFound, SwarmrunError, UsageError

__all__ = ["Client", "coordinator_url", "api_token"]

_MAX_ANSWER = 16 * 2**20


def coordinator_url(value: Optional[str]) -> str:
    """``--coordinator`` or ``$SWARMRUN_COORDINATOR``. Raises UsageError when neither is set."""
    url = value or os.environ.get("SWARMRUN_COORDINATOR")
    if not url:
        raise UsageError("give --coordinator URL (or SWARMRUN_COORDINATOR)")
    if "://" not in url:
        url = f"http://{url}"
    return url.rstrip("/")


def api_token(value: Optional[str]) -> str:
    """``--token`` or ``$SWARMRUN_TOKEN``. Raises UsageError when neither is set."""
    token = value or os.environ.get("SWARMRUN_TOKEN")
    if not token:
        raise UsageError("give --token TOKEN (or SWARMRUN_TOKEN); `node coordinator user add NAME` prints one")
    return token


class Client:
    """Calls ``METHOD URL/api/PATH`` with the user's bearer token; returns the decoded JSON answer."""

    def __init__(self, url: str, token: str, *, timeout: float = 10.0) -> None:
        self.url, self.token, self.timeout = url, token, timeout

    def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/api/{path.lstrip('/')}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as answer:
                return json.loads(answer.read(_MAX_ANSWER))
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read(65536)).get("error", e.reason)
            except ValueError:
                message = str(e.reason)
            raise _error(e.code, message) from None
        except (urllib.error.URLError, OSError) as e:
            raise RunNotFound(f"coordinator {self.url} unreachable: {getattr(e, 'reason', e)}") from None

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        return self.request("POST", path, {} if body is None else body)


def _error(status: int, message: str) -> SwarmrunError:
    if status in (401, 403):
        return AccessRefused(message)
    if status == 404:
        return RunNotFound(message)
    if status in (400, 409, 413, 422):
        return UsageError(message)
    return SwarmrunError(f"coordinator answered {status}: {message}")
