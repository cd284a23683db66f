"""A user-space delay proxy: latency for a peer's links where the kernel has no netem.

One :class:`DelayProxy` listens on one address and forwards every connection it accepts to one upstream
address (the peer's real ``--listen``), holding each direction's bytes for ``delay_ms`` before passing
them on: a connection through it gains ``2 * delay_ms`` of round-trip time. The peer announces the proxy's
address (``node join --announce``), so every peer that dials it (p2pd dials the announced address; the
runner's ``--peers`` are the announced addresses too) passes the proxy. A connection between two peers
passes exactly one proxy, the one of the peer that was dialed: with one ``latency_ms`` for every peer, each
link gets that one-way delay whoever dialed.

Buffers are bounded: each direction holds at most ``max_chunks`` reads of up to ``CHUNK`` bytes; when full
the proxy stops reading that side, so TCP's own flow control slows the sender (no unbounded memory).

Run as a process, ``python -m simulations.delayproxy --listen HOST:PORT --to HOST:PORT --delay-ms N``: it
prints one JSON line ``{"event": "ready", "port": P}`` once it listens, reads commands on stdin
(``delay MS`` changes the delay for everything not yet forwarded, ``stats`` prints the counters as one JSON
line), and exits when its stdin closes (the runner that started it exited or closed it), on SIGTERM, or on
SIGINT. So it stops by itself with the run, even when the runner is SIGKILLed.

:func:`direct_connections` reads ``/proc/<pid>/net/tcp`` to find connections that reached a peer's real
port without a proxy: the runner's evidence that the latency really applied to every link.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

CHUNK = 64 * 1024


@dataclass
class Stats:
    connections: int = 0  # accepted
    upstream_failures: int = 0  # accepted but the upstream refused or timed out
    open: int = 0
    bytes_in: int = 0  # client -> upstream
    bytes_out: int = 0  # upstream -> client

    def as_dict(self) -> dict:
        return dict(connections=self.connections, upstream_failures=self.upstream_failures, open=self.open,
                    bytes_in=self.bytes_in, bytes_out=self.bytes_out)


class DelayProxy:
    """Forward ``listen`` -> ``upstream``, each direction delayed by ``delay_ms`` (changeable while it runs)."""

    def __init__(self, upstream: tuple[str, int], delay_ms: float, *, max_chunks: int = 64,
                 connect_timeout: float = 10.0):
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.upstream, self.delay_ms = upstream, float(delay_ms)
        self.max_chunks, self.connect_timeout = max_chunks, connect_timeout
        self.stats = Stats()
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the port (the one the OS chose when ``port`` is 0)."""
        self._server = await asyncio.start_server(self._accept, host, port)
        return self._server.sockets[0].getsockname()[1]

    def set_delay(self, delay_ms: float) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.delay_ms = float(delay_ms)

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.connections += 1
        try:
            try:
                u_reader, u_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream),
                                                            self.connect_timeout)
            except (OSError, asyncio.TimeoutError):
                self.stats.upstream_failures += 1
                c_writer.close()
                return
            self.stats.open += 1
            try:
                pumps = [asyncio.create_task(self._pump(c_reader, u_writer, "bytes_in")),
                         asyncio.create_task(self._pump(u_reader, c_writer, "bytes_out"))]
                try:
                    # both directions to their end (a half-close passes on); an error in one ends both
                    done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                    for p in pending:
                        p.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
                finally:
                    for p in pumps:
                        p.cancel()
            finally:
                self.stats.open -= 1
                for w in (u_writer, c_writer):
                    w.close()
        finally:
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """One direction: a reader that timestamps chunks into a bounded queue, a writer that releases each
        chunk when its time comes. The queue keeps the order; the bound is the back-pressure."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(self.max_chunks)

        async def read_side() -> None:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((loop.time(), data))  # blocks when full: we stop reading, TCP slows the sender
                if not data:
                    return

        reading = asyncio.create_task(read_side())
        try:
            while True:
                t, data = await queue.get()
                wait = t + self.delay_ms / 1000.0 - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:  # the sender half-closed: pass it on once its last bytes went
                    if writer.can_write_eof():
                        writer.write_eof()
                    break
                writer.write(data)
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                await writer.drain()
            await reading
        finally:
            reading.cancel()


# ---- evidence that every link passed a proxy -----------------------------------------------------------
ESTABLISHED = "01"


def parse_proc_tcp(text: str) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """Rows of a ``/proc/net/tcp`` text: (local (ip, port), remote (ip, port), state hex, inode). IPv4 only."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            rows.append((_addr(parts[1]), _addr(parts[2]), parts[3], int(parts[9])))
        except ValueError:
            continue
    return rows


def _addr(hexaddr: str) -> tuple[str, int]:
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)[::-1]  # little-endian on every machine this runs on (x86, arm64)
    return ".".join(str(b) for b in raw), int(port_hex, 16)


def direct_connections(rows: Iterable[tuple], peer_ports: set, proxy_inodes: set) -> list[tuple]:
    """Established connections *dialed to* a peer's real listen port by a socket that is not a proxy's: the
    dialer learnt an address other than the announced one. ``rows`` from :func:`parse_proc_tcp`,
    ``peer_ports`` the peers' real (ip, port), ``proxy_inodes`` the socket inodes the proxies hold."""
    return [(local, remote) for local, remote, state, inode in rows
            if state == ESTABLISHED and remote in peer_ports and inode not in proxy_inodes]


def socket_inodes(pid: int) -> set:
    """The socket inodes a process holds (empty when it is gone)."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


class LinkAudit:
    """Scans, every so often, for connections that reached a peer's real port without a proxy. One seen in two
    scans in a row counts (a scan is not atomic: a proxy socket closed between reading the table and reading
    the proxy's descriptors would look direct once; p2pd's connections last far longer than a scan)."""

    def __init__(self):
        self.scans = 0
        self.direct: set = set()  # confirmed (dialer, real port) pairs
        self._last: set = set()

    def scan(self, peer_ports: set, proxy_pids: Sequence[int], tables: Sequence[str]) -> None:
        """``tables``: paths of ``/proc/.../net/tcp`` files covering every namespace peers dial from."""
        inodes = set().union(*(socket_inodes(p) for p in proxy_pids)) if proxy_pids else set()
        rows = []
        for path in tables:
            try:
                with open(path) as f:
                    rows += parse_proc_tcp(f.read())
            except OSError:
                continue
        inodes |= set().union(*(socket_inodes(p) for p in proxy_pids)) if proxy_pids else set()
        now = set(direct_connections(rows, peer_ports, inodes))
        self.direct |= now & self._last
        self._last = now
        self.scans += 1


@dataclass
class ProxyHandle:
    """A proxy process the runner started: its port, and its stdin for commands."""

    proc: "subprocess.Popen"
    port: int
    upstream: tuple[str, int]
    delay_ms: float

    def set_delay(self, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self._send(f"delay {delay_ms:g}\n")

    def stats(self, timeout: float = 3.0) -> Optional[dict]:
        """The proxy's counters, or None when it does not answer within ``timeout``."""
        import select

        if not self._send("stats\n"):
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            line = self.proc.stdout.readline()
            if not line:
                return None
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == "stats":
                return row
        return None

    def _send(self, text: str) -> bool:
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False


def start_proxy(listen: tuple[str, int], upstream: tuple[str, int], delay_ms: float, *, log,
                prefix: Sequence[str] = (), ready_timeout: float = 30.0) -> ProxyHandle:
    """Start ``python -m simulations.delayproxy`` in its own session (under ``prefix``, e.g. ``ip netns exec NS``)
    and wait for its port. It exits when the runner closes its stdin or exits.

    Raises:
        RuntimeError: it did not report a port within ``ready_timeout`` (it is killed).
    """
    import select

    cmd = [*prefix, sys.executable, "-m", "simulations.delayproxy", "--listen", f"{listen[0]}:{listen[1]}",
           "--to", f"{upstream[0]}:{upstream[1]}", "--delay-ms", f"{delay_ms:g}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=root,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], ready_timeout)
    line = proc.stdout.readline() if ready else b""
    try:
        port = int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        raise RuntimeError(f"the delay proxy for {upstream[0]}:{upstream[1]} did not start") from None
    return ProxyHandle(proc=proc, port=port, upstream=upstream, delay_ms=delay_ms)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (for a peer's real ``--listen``: the announce needs explicit ports)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the process ------------------------------------------------------------------------------------------
def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"HOST:PORT, got {text!r}")
    return host, int(port)


async def _serve(args: argparse.Namespace) -> int:
    proxy = DelayProxy(args.to, args.delay_ms, max_chunks=args.max_chunks)
    port = await proxy.start(*args.listen)
    print(json.dumps(dict(event="ready", port=port, pid=os.getpid())), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    async def commands() -> None:
        while True:
            line = await stdin.readline()
            if not line:  # whoever started us is gone, or is done with us
                stop.set()
                return
            words = line.decode(errors="replace").split()
            if len(words) == 2 and words[0] == "delay":
                try:
                    proxy.set_delay(float(words[1]))
                except ValueError:
                    pass
            elif words == ["stats"]:
                print(json.dumps(dict(event="stats", delay_ms=proxy.delay_ms, **proxy.stats.as_dict())), flush=True)

    reader = asyncio.create_task(commands())
    await stop.wait()
    reader.cancel()
    await proxy.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.delayproxy",
                                description="forward TCP with a delay in each direction; exits when stdin closes")
    p.add_argument("--listen", type=_hostport, required=True, metavar="HOST:PORT", help="port 0: any free port")
    p.add_argument("--to", type=_hostport, required=True, metavar="HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--max-chunks", type=int, default=64, help=f"per direction, of up to {CHUNK} bytes each")
    args = p.parse_args(argv)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
