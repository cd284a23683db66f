"""A declared length over its type's bound closes the stream before the body is buffered (net/bounds.py)."""

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from swarmrun.node.net.bounds import AVERAGER_BOUNDS, DeclaredTooLarge, bounded_receive_protobuf


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_declared_length_over_the_bound_is_refused_before_the_body_is_read():
    async def go():
        body = b"\x00" * 4096  # the first bytes of a stream that declares 2**40
        reader = _reader(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        with pytest.raises(DeclaredTooLarge, match="JoinRequest"):
            await bounded_receive_protobuf(averaging_pb2.JoinRequest, reader)
        assert await reader.read() == body  # not one byte of the body was consumed
        # just over the bound: refused too; a real message within it is read as hivemind reads it
        over = AVERAGER_BOUNDS["AveragingData"] + 1
        with pytest.raises(DeclaredTooLarge):
            await bounded_receive_protobuf(averaging_pb2.AveragingData,
                                           _reader(P2P.MESSAGE_MARKER + over.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)))
        msg = averaging_pb2.JoinRequest(schema_hash=b"s", gather=b"g" * 1000)
        data = msg.SerializeToString()
        got, err = await bounded_receive_protobuf(
            averaging_pb2.JoinRequest, _reader(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
                                               + data))
        assert err is None and got == msg

    asyncio.run(go())
