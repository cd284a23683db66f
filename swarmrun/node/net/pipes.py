"""hivemind's control pipes, read whole under uvloop.

hivemind's DHT and averager processes serve their host through one end of a ``multiprocessing.Pipe`` each: they
register it with ``loop.add_reader`` (only to be woken) and then read it with a plain ``Connection.recv()``.
uvloop makes a registered descriptor non-blocking, so a message longer than what one read returns (the socket
buffer: a round's context with a large data cursor, a schema validator of ~16 KB in a busy moment) raises
``BlockingIOError`` in the middle of it; hivemind logs that and reads again from the middle of the message, and
the process dies on the next ``recv`` (``EOFError: Ran out of input``). The averager dying that way left all four
peers of a 2.1M-parameter run on 295k examples stalled at step 5 for 15 minutes ("could not find a group"),
measured with ``benchmarks/links.py``.

``whole_messages`` wraps the process's end so that each ``recv`` and ``send`` runs on a blocking descriptor: once
the wake-up said a message is there, the rest of it arrives as fast as the host writes it.
"""

from __future__ import annotations

import os

__all__ = ["whole_messages"]


class _WholeMessages:
    """A ``multiprocessing.connection.Connection`` whose reads and writes take whole messages."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def recv(self):
        os.set_blocking(self._conn.fileno(), True)
        return self._conn.recv()

    def send(self, obj) -> None:
        os.set_blocking(self._conn.fileno(), True)
        self._conn.send(obj)

    def __getattr__(self, name):  # fileno, poll, close, ...: the connection's own
        return getattr(self._conn, name)


def whole_messages(conn):
    """``conn`` (hivemind's ``_inner_pipe``) with whole-message reads and writes (idempotent)."""
    return conn if isinstance(conn, _WholeMessages) else _WholeMessages(conn)
