"""Peers in their own network namespaces, on one bridge, with shaped links (``tc``) and drop rules (nftables).

Layout: a bridge ``srb<tag>`` in the root namespace holds ``10.<a>.<b>.1/24``; peer ``i`` lives in namespace
``sr<tag>-<i>`` behind a veth pair (host side on the bridge) with address ``.i+2``. The kernel here has no
netem, so: bandwidth is ``tc tbf`` on both ends of the veth (egress of each side); loss and partitions are an
nftables ``input`` chain inside the receiving peer's namespace (``numgen random`` for loss, ``ip saddr``
for a partition's other side). Rules are rebuilt from the peer's link state each time (``nft -f``), so the
state is the single source of truth and healing is applying an empty state.

Everything created is torn down by :meth:`Network.close` (idempotent), which the runner calls in ``finally``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Optional

from swarmrun.protocol.errors import SwarmrunError, UsageError

logger = logging.getLogger("simulations.netns")


@dataclass
class Link:
    """One peer's link: what the runner asked for, rebuilt into tc and nft state on every change."""

    ns: str
    host_if: str
    peer_if: str
    ip: str
    rate: Optional[str] = None
    loss_percent: float = 0.0
    blocked: set = field(default_factory=set)  # source IPs dropped on input (a partition's other side)


def nft_ruleset(link: Link) -> str:
    """The nftables script (for ``nft -f -``) of a link's drop rules: a pure function of its state."""
    lines = ["table inet swarmsim", "delete table inet swarmsim", "table inet swarmsim {",
             "  chain input {", "    type filter hook input priority 0; policy accept;"]
    if link.blocked:
        lines.append(f"    ip saddr {{ {', '.join(sorted(link.blocked))} }} drop")
    if link.loss_percent > 0:
        lines.append(f'    iifname != "lo" numgen random mod 1000 < {int(round(link.loss_percent * 10))} drop')
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def check_available() -> None:
    """Raises UsageError when namespaces cannot be made here (not root, or ip/tc/nft missing)."""
    if os.geteuid() != 0:
        raise UsageError("this trace has \"links\": true, which needs root (network namespaces, tc, nftables)")
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"this trace has \"links\": true, which needs {', '.join(missing)} on PATH "
                         f"(packages iproute2, nftables)")


class Network:
    """The namespaces and bridge of one simulation run. ``tag`` keeps concurrent runs apart."""

    def __init__(self, tag: str, subnet: int):
        self.tag, self.subnet = tag, subnet
        self.bridge = f"srb{tag}"
        self.links: dict[str, Link] = {}
        self._up = False

    def _ip(self, host: int) -> str:
        return f"10.{200 + self.subnet // 250}.{self.subnet % 250}.{host}"

    def open(self) -> None:
        check_available()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._up = True
        _sh("ip", "addr", "add", f"{self._ip(1)}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")

    def add_peer(self, name: str, index: int, rate: Optional[str]) -> Link:
        """A namespace for peer ``name`` (the ``index``-th peer of the run), reachable from the others."""
        if name in self.links:
            return self.links[name]
        if index > 250:
            raise UsageError("at most 250 peers per trace with links")
        link = Link(ns=f"sr{self.tag}-{index}", host_if=f"sr{self.tag}h{index}", peer_if=f"sr{self.tag}p{index}",
                    ip=self._ip(index + 2), rate=rate)
        self.links[name] = link
        _sh("ip", "netns", "add", link.ns)
        _sh("ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.peer_if)
        _sh("ip", "link", "set", link.peer_if, "netns", link.ns)
        _sh("ip", "link", "set", link.host_if, "master", self.bridge)
        _sh("ip", "link", "set", link.host_if, "up")
        _sh("ip", "netns", "exec", link.ns, "ip", "addr", "add", f"{link.ip}/24", "dev", link.peer_if)
        _sh("ip", "netns", "exec", link.ns, "ip", "link", "set", link.peer_if, "up")
        _sh("ip", "netns", "exec", link.ns, "ip", "link", "set", "lo", "up")
        self.apply(name)
        return link

    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a process inside the peer's namespace."""
        return ["ip", "netns", "exec", self.links[name].ns]

    def apply(self, name: str) -> None:
        """Rebuild the tc and nft state of a peer's link from its :class:`Link`."""
        link = self.links[name]
        for ns, dev in ((None, link.host_if), (link.ns, link.peer_if)):
            pre = ["ip", "netns", "exec", ns] if ns else []
            subprocess.run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if link.rate:
                _sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", link.rate,
                    "burst", "32kbit", "latency", "400ms")
        _sh("ip", "netns", "exec", link.ns, "nft", "-f", "-", stdin=nft_ruleset(link))

    def set_rate(self, name: str, rate: Optional[str]) -> None:
        self.links[name].rate = rate
        self.apply(name)

    def set_loss(self, name: str, percent: float) -> None:
        self.links[name].loss_percent = percent
        self.apply(name)

    def partition(self, side: set[str]) -> None:
        """Cut ``side`` off from every other peer (both directions); heal with an empty set."""
        ips = {n: link.ip for n, link in self.links.items()}
        for name, link in self.links.items():
            link.blocked = set() if not side else {ips[o] for o in self.links if (o in side) != (name in side)}
            self.apply(name)

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each peer's namespace sent on its link so far (everything: the swarm's tensors, DHT, framing):
        what its veth's host side received, read from the root namespace."""
        out = {}
        for name, link in self.links.items():
            try:
                out[name] = int(open(f"/sys/class/net/{link.host_if}/statistics/rx_bytes").read())
            except (OSError, ValueError):
                pass
        return out

    def close(self) -> None:
        """Delete every namespace, veth and the bridge (idempotent; errors are logged, not raised)."""
        for link in self.links.values():
            subprocess.run(["ip", "link", "del", link.host_if], capture_output=True)
            subprocess.run(["ip", "netns", "del", link.ns], capture_output=True)
        self.links.clear()
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._up = False


def _sh(*cmd: str, stdin: Optional[str] = None) -> None:
    r = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise SwarmrunError(f"{' '.join(cmd)} failed: {r.stderr.strip() or r.returncode}")
