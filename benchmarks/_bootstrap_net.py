"""Network namespaces for the capped part of the bootstrap benchmark (needs root, ``ip`` and ``tc``).

Every provider gets its own namespace, joined to the host by a veth pair whose host end sits on one bridge (so
providers reach each other and the joiner, which stays in the host namespace on the bridge's address). The
namespace end of each veth carries a ``tc tbf`` qdisc: the provider's upload is capped (this kernel has no netem;
tbf is enough to cap a rate). Names carry a random tag so two runs never collide; ``close`` removes everything and
is safe to call twice.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass, field


class NetError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class CappedNet:
    """``providers`` namespaces, each with its upload capped at ``rate_mbit`` megabits/s (1e6 bits)."""

    providers: int
    rate_mbit: float
    burst: str = "128kb"
    latency: str = "100ms"
    tag: str = field(default_factory=lambda: f"{random.randrange(16 ** 4):04x}")
    namespaces: list[str] = field(default_factory=list)
    provider_hosts: list[str] = field(default_factory=list)
    joiner_host: str = ""
    _bridge: str = ""

    def open(self) -> "CappedNet":
        used = _ip("ip", "-4", "-o", "addr").stdout
        subnet = next((f"10.213.{x}" for x in random.sample(range(1, 255), 254) if f" 10.213.{x}." not in used), None)
        if subnet is None:
            raise NetError("no free 10.213.x.0/24 subnet")
        self._bridge = f"srb{self.tag}br"
        self.joiner_host = f"{subnet}.1"
        try:
            _ip("ip", "link", "add", self._bridge, "type", "bridge")
            _ip("ip", "addr", "add", f"{self.joiner_host}/24", "dev", self._bridge)
            _ip("ip", "link", "set", self._bridge, "up")
            for i in range(self.providers):
                ns, host_end, ns_end = f"srb{self.tag}p{i}", f"srb{self.tag}v{i}", f"srb{self.tag}n{i}"
                _ip("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                _ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _ip("ip", "link", "set", ns_end, "netns", ns)
                _ip("ip", "link", "set", host_end, "master", self._bridge)
                _ip("ip", "link", "set", host_end, "up")
                address = f"{subnet}.{10 + i}"
                _ip("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ns_end)
                _ip("ip", "-n", ns, "link", "set", ns_end, "up")
                _ip("ip", "-n", ns, "link", "set", "lo", "up")
                _ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_end, "root", "tbf",
                    "rate", f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency)
                self.provider_hosts.append(address)
        except BaseException:
            self.close()
            raise
        return self

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process in provider ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def qdisc_stats(self) -> list[str]:
        """``tc -s qdisc`` of each provider's capped link (sent bytes, drops, overlimits), for the report."""
        out = []
        for i, ns in enumerate(self.namespaces):
            done = _ip("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", f"srb{self.tag}n{i}", check=False)
            out.append(" ".join(done.stdout.split()))
        return out

    def close(self) -> None:
        """Remove the veths, namespaces and bridge (kill the processes inside first: a namespace lives on while
        a process is in it)."""
        for i, ns in enumerate(self.namespaces):
            _ip("ip", "link", "del", f"srb{self.tag}v{i}", check=False)  # deletes the pair
            _ip("ip", "netns", "del", ns, check=False)
        self.namespaces = []
        if self._bridge:
            _ip("ip", "link", "del", self._bridge, check=False)
            self._bridge = ""

    def __enter__(self) -> "CappedNet":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
