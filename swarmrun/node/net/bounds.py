"""Bounds before admission on hivemind's protobuf stream handlers (invariant 6, issue 14).

hivemind reads every protobuf stream message through ``P2P.receive_protobuf`` -> ``P2P.receive_raw_data``, which
reads an 8-byte declared length and then ``readexactly`` that many bytes: a stranger who declares 2**40 bytes to the
averager's ``rpc_join_group`` makes the process buffer whatever it streams, before any handler (or swarmrun's
admission in ``RoundAverager.rpc_join_group``) sees a byte. Both are static methods called through the class name
(``P2P.receive_protobuf(...)`` inside ``_add_protobuf_stream_handler`` and ``_iterate_protobuf_stream_handler``), so
a subclass of ``P2P`` cannot intercept them: ``install_protobuf_bounds`` replaces ``P2P.receive_protobuf`` in the
process that calls it (the averager's, from ``RoundAverager.run``) with one that checks the declared length against
a bound per message type and closes the stream before reading the body. Types not in the table keep hivemind's
behaviour (the DHT's own messages run in the DHT's process, which this does not touch).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Mapping, Optional

from hivemind.p2p import P2P
from hivemind.proto.p2pd_pb2 import RPCError

logger = logging.getLogger("swarmrun.bounds")

#: bytes a declared message of each averager type may have. JoinRequest: a follower's gathered metadata (swarmrun's
#: ``RoundMeta`` is at most 64 KiB) plus hivemind's fields; MessageFromLeader: the gathered metadata of a whole group;
#: AveragingData: one tensor part (hivemind's part_size_bytes, 512 KiB by default, compressed at most once) plus its
#: fields; RPCError: an error text.
AVERAGER_BOUNDS: Mapping[str, int] = {
    "JoinRequest": 1 << 20,
    "MessageFromLeader": 32 << 20,
    "AveragingData": 4 << 20,
}
MAX_ERROR_BYTES = 64 << 10

_installed: Optional[Mapping[str, int]] = None


class DeclaredTooLarge(ConnectionError):
    """A peer declared a message over its type's bound: the stream is closed before the body is read."""


async def bounded_receive_protobuf(input_protobuf_type, reader: asyncio.StreamReader, *,
                                   bounds: Mapping[str, int] = AVERAGER_BOUNDS):
    """``P2P.receive_protobuf`` with a bound on the declared length, checked before the body is buffered.

    Raises:
        DeclaredTooLarge: the declared length is over the bound of the message's type.
    """
    msg_type = await reader.readexactly(1)
    if msg_type == P2P.MESSAGE_MARKER:
        kind, bound = input_protobuf_type, bounds.get(input_protobuf_type.DESCRIPTOR.name)
    elif msg_type == P2P.ERROR_MARKER:
        kind, bound = RPCError, MAX_ERROR_BYTES
    else:
        raise TypeError("Invalid Protobuf message type")
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if bound is not None and length > bound:
        raise DeclaredTooLarge(f"a peer declared a {kind.DESCRIPTOR.name} of {length} bytes (at most {bound}): "
                               f"stream closed before reading it")
    protobuf = kind()
    protobuf.ParseFromString(await reader.readexactly(length))
    return (protobuf, None) if kind is input_protobuf_type and msg_type == P2P.MESSAGE_MARKER else (None, protobuf)


def install_protobuf_bounds(bounds: Mapping[str, int] = AVERAGER_BOUNDS) -> None:
    """Bound every protobuf stream message this process receives through hivemind's ``P2P`` (idempotent)."""
    global _installed
    if _installed is not None:
        return

    async def receive_protobuf(input_protobuf_type, reader):
        return await bounded_receive_protobuf(input_protobuf_type, reader, bounds=bounds)

    P2P.receive_protobuf = staticmethod(receive_protobuf)
    _installed = bounds
