"""The delay proxy: bytes arrive intact and in order, no sooner than the delay, with bounded buffers; the process
form reports its port and exits when its stdin closes. Only lower bounds on time are asserted."""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.delayproxy import DelayProxy, direct_connections, parse_proc_tcp

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.timeout(60)


async def _echo_server():
    """An upstream that echoes every byte back and half-closes when its client does."""
    async def handle(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_round_trip_is_intact_in_order_and_delayed_both_ways():
    server, port = await _echo_server()
    proxy = DelayProxy(("127.0.0.1", port), delay_ms=150)
    pport = await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", pport)
        t0 = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        assert time.monotonic() - t0 >= 2 * 0.150  # one delay each way (a lower bound only)
        messages = [f"message {i};".encode() * (i + 1) for i in range(200)]
        for m in messages:
            writer.write(m)
        await writer.drain()
        writer.write_eof()  # the half-close passes through: the echo server ends, and so does our read
        assert await reader.read() == b"".join(messages)
        writer.close()
    finally:
        await proxy.close()
        server.close()
    assert proxy.stats.connections == 1 and proxy.stats.upstream_failures == 0
    assert proxy.stats.bytes_in == proxy.stats.bytes_out == 4 + sum(map(len, messages))


async def test_a_large_transfer_through_small_buffers_arrives_intact():
    server, port = await _echo_server()
    proxy = DelayProxy(("127.0.0.1", port), delay_ms=5, max_chunks=2)  # at most 2 reads held per direction
    pport = await proxy.start()
    payload = os.urandom(8 * 1024 * 1024)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", pport)

        async def send():
            for i in range(0, len(payload), 100_000):
                writer.write(payload[i:i + 100_000])
                await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        got = await reader.read(-1)
        await sender
        writer.close()
    finally:
        await proxy.close()
        server.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()


async def test_the_delay_changes_while_it_runs():
    server, port = await _echo_server()
    proxy = DelayProxy(("127.0.0.1", port), delay_ms=0)
    pport = await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", pport)
        proxy.set_delay(200)
        t0 = time.monotonic()
        writer.write(b"x")
        await writer.drain()
        assert await reader.readexactly(1) == b"x"
        assert time.monotonic() - t0 >= 2 * 0.200
        writer.close()
    finally:
        await proxy.close()
        server.close()
    with pytest.raises(ValueError):
        proxy.set_delay(-1)


async def test_an_unreachable_upstream_closes_the_client():
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    proxy = DelayProxy(("127.0.0.1", dead_port), delay_ms=10)
    pport = await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", pport)
        assert await reader.read() == b""
        writer.close()
    finally:
        await proxy.close()
    assert proxy.stats.upstream_failures == 1 and proxy.stats.open == 0


def test_the_process_reports_its_port_forwards_and_exits_when_stdin_closes():
    import socket

    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(1)
    proc = subprocess.Popen([sys.executable, "-m", "simulations.delayproxy", "--listen", "127.0.0.1:0",
                             "--to", f"127.0.0.1:{upstream.getsockname()[1]}", "--delay-ms", "100"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["pid"] == proc.pid
        client = socket.create_connection(("127.0.0.1", ready["port"]))
        conn, _ = upstream.accept()
        t0 = time.monotonic()
        client.sendall(b"hello")
        assert conn.recv(5) == b"hello"
        assert time.monotonic() - t0 >= 0.100
        proc.stdin.write(b"stats\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
        assert stats["event"] == "stats" and stats["connections"] == 1 and stats["bytes_in"] == 5
        proc.stdin.close()  # the runner gone: the proxy ends by itself
        assert proc.wait(timeout=20) == 0
        client.close()
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        upstream.close()


PROC_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0
   1: 0100007F:D431 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 201 1 0
   2: 0100007F:D432 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 202 1 0
   3: 0100007F:9C40 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 301 1 0
   4: 0100007F:D433 0100007F:9C41 06 00000000:00000000 00:00000000 00000000     0        0 0 1 0
"""


def test_direct_connections_are_the_dials_to_a_real_port_by_no_proxy():
    rows = parse_proc_tcp(PROC_TCP)
    assert rows[0] == (("127.0.0.1", 40000), ("0.0.0.0", 0), "0A", 100)
    peer_ports = {("127.0.0.1", 40000)}
    # 201 is the proxy's upstream socket; 202 dialed port 40000 on its own; 301 is the accepted end (not a dial)
    assert direct_connections(rows, peer_ports, {201}) == [(("127.0.0.1", 54322), ("127.0.0.1", 40000))]
    assert direct_connections(rows, peer_ports, {201, 202}) == []
