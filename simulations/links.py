"""A trace's links: the peers' network namespaces (``netns.Network``, traces with ``"links": true``) and their
delay proxies (traces with latency), with the audit that no connection bypassed a proxy. The runner asks where a
peer listens and changes a link when the trace says so; everything here is torn down by :meth:`Links.close`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional

from swarmrun.protocol.errors import SwarmrunError

from .delayproxy import LinkAudit, ProxyHandle, free_port, start_proxy
from .trace import Trace

PEER_PORT_IN_NAMESPACE = 4001  # a proxied peer's real port in its own namespace (its proxy's port is the OS's)
AUDIT_EVERY = 5.0  # seconds between two scans for connections that bypassed a delay proxy


class Links:
    """The network of one simulation. ``now``: the runner's clock (the audit's cadence)."""

    def __init__(self, trace: Trace, *, logs: Path, emit: Callable[..., None], now: Callable[[], float]):
        self.trace, self.logs, self.emit, self.now = trace, logs, emit, now
        self.network = None
        self.proxies: dict[str, ProxyHandle] = {}  # peer name -> its delay proxy (traces with latency)
        self.audit = LinkAudit()
        self._next_audit = 0.0

    def open(self) -> None:
        if self.trace.links:
            from .netns import Network

            self.network = Network(f"{os.getpid() % 0xFFFF:04x}", os.getpid() % 1000)
            self.network.open()

    def attach(self, name: str, index: int) -> tuple[list[str], list[str]]:
        """A peer about to start: (the command prefix that runs it in its namespace, its ``--listen``/``--announce``
        flags)."""
        prefix: list[str] = []
        host = "127.0.0.1"
        if self.network is not None:
            link = self.network.add_peer(name, index, self.trace.link_rate)
            host, prefix = link.ip, self.network.prefix(name)
        if self.trace.proxied:
            proxy = self._proxy(name, host, prefix)
            return prefix, ["--listen", f"/ip4/{host}/tcp/{proxy.upstream[1]}", "--announce", f"/ip4/{host}/tcp/{proxy.port}"]
        if self.network is not None:
            return prefix, ["--listen", f"/ip4/{host}/tcp/0"]
        return prefix, []

    def _proxy(self, name: str, host: str, prefix: list[str]) -> ProxyHandle:
        """The peer's delay proxy (one per name, kept across its incarnations, so a rejoin keeps its ports): it
        listens on an OS-chosen port and forwards to the peer's real port. In a namespace both live in the
        peer's namespace (the proxy's inbound connections keep the dialer's address, so the partition and loss
        rules still see who sent what); on loopback the real port is one free now."""
        if name in self.proxies:
            return self.proxies[name]
        upstream = (host, PEER_PORT_IN_NAMESPACE if prefix else free_port(host))
        log = open(self.logs / f"proxy-{name}.log", "ab")
        try:
            proxy = start_proxy((host, 0), upstream, self.trace.latency_ms or 0.0, log=log, prefix=prefix)
        except RuntimeError as e:
            raise SwarmrunError(f"{e} (see {self.logs / f'proxy-{name}.log'})") from None
        finally:
            log.close()
        self.proxies[name] = proxy
        self.emit("sim", message=f"{name}: delay proxy {host}:{proxy.port} -> {host}:{upstream[1]}, "
                                 f"{proxy.delay_ms:g} ms each way")
        return proxy

    def audit_now(self) -> None:
        """Every few seconds, look for a connection that reached a peer's real port without its proxy."""
        if not self.proxies or self.now() < self._next_audit:
            return
        self._next_audit = self.now() + AUDIT_EVERY
        pids = [p.proc.pid for p in self.proxies.values() if p.proc.poll() is None]
        tables = [f"/proc/{pid}/net/tcp" for pid in pids] if self.network is not None else ["/proc/net/tcp"]
        self.audit.scan({p.upstream for p in self.proxies.values()}, pids, tables)

    # ---- what the trace changes ----------------------------------------------------------------------
    def partition(self, side: set) -> None:
        self.network.partition(side)

    def set_rate(self, name: str, rate: Any) -> None:
        self.network.set_rate(name, rate)

    def set_loss(self, name: str, percent: float) -> None:
        self.network.set_loss(name, percent)

    def set_delay(self, name: str, ms: Optional[float]) -> None:
        """``ms`` None: back to the trace's own latency."""
        self.proxies[name].set_delay((self.trace.latency_ms or 0.0) if ms is None else ms)

    def restore(self, name: str, *, rate: Any = "keep", loss: Optional[float] = None) -> bool:
        """Back to the trace's own link; False when the peer has no link (nothing to restore)."""
        if self.network is None or name not in self.network.links:
            return False
        if rate != "keep":
            self.network.set_rate(name, rate)
        if loss is not None:
            self.network.set_loss(name, loss)
        return True

    # ---- the end -------------------------------------------------------------------------------------
    def report(self) -> Optional[dict]:
        """The proxies' figures for the record (None without proxies)."""
        if not self.proxies:
            return None
        return dict(latency_ms=self.trace.latency_ms, scans=self.audit.scans,
                    direct_connections=sorted(f"{a[0]}:{a[1]} -> {b[0]}:{b[1]}" for a, b in self.audit.direct),
                    per_peer={n: p.stats() for n, p in self.proxies.items()})

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each peer sent on its link (traces with ``"links": true``; empty otherwise)."""
        return self.network.sent_bytes() if self.network is not None else {}

    def stop_proxies(self) -> list[int]:
        """Ask each proxy to exit (it does on its stdin's end); their process groups, for the SIGKILL after."""
        for p in self.proxies.values():
            try:
                p.proc.stdin.close()
            except OSError:
                pass
        return [p.proc.pid for p in self.proxies.values()]

    def wait_proxies(self) -> None:
        for p in self.proxies.values():
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        if self.network is not None:
            self.network.close()
