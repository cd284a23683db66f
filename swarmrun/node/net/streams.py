"""Framing of the state-transfer streams: a bounded msgpack header, then raw bytes."""

from __future__ import annotations

import asyncio
import logging

from swarmrun.protocol.transfer import HEADER_PREFIX, decode_message, frame, header_length

logger = logging.getLogger("swarmrun.transfer")


def quiet_dropped_streams(loop: asyncio.AbstractEventLoop) -> None:
    """p2pd sometimes dials the handler socket and hangs up before naming the stream (a stream the remote reset);
    hivemind's handler then raises IncompleteReadError into asyncio's default handler, a traceback per stream.
    Those go to the debug log; every other unhandled error still reaches the default handler."""
    previous = loop.get_exception_handler()

    def handler(loop, context):
        if isinstance(context.get("exception"), asyncio.IncompleteReadError) and \
                "client_connected_cb" in context.get("message", ""):
            logger.debug(f"p2pd dropped a stream before it started: {context['exception']!r}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def read_header(reader: asyncio.StreamReader):
    n = header_length(await reader.readexactly(HEADER_PREFIX))
    return decode_message(await reader.readexactly(n))


async def write_message(writer: asyncio.StreamWriter, header: bytes, payload=None) -> None:
    writer.write(frame(header))
    if payload is not None:
        writer.write(payload)
    await writer.drain()


async def send(writer: asyncio.StreamWriter, data: bytes, payload=None) -> None:
    """Write bytes a session returned (and a chunk's raw bytes after its header), then wait for the buffer."""
    writer.write(data)
    if payload is not None:
        writer.write(payload)
    await writer.drain()
