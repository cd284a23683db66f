"""Small helpers of the one asyncio loop every process of ours runs: start it, await hivemind's futures."""

from __future__ import annotations

import asyncio
from typing import Optional

import psutil


async def await_future(mpfuture, timeout: float = 30.0):
    """Await a hivemind MPFuture, bounded: if its process died, the future would never resolve."""
    return await asyncio.wait_for(asyncio.ensure_future(_wrap(mpfuture)), timeout)


async def _wrap(mpfuture):
    return await mpfuture


def run_async(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def kill_descendants(timeout: float = 3.0, pid: Optional[int] = None) -> None:
    """End every process below ``pid`` (default: this one): hivemind's DHT and averager processes and their
    ``p2pd``, which outlive their parent otherwise. SIGTERM, then SIGKILL after ``timeout``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
