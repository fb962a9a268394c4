"""Network partitions between addresses of a localkube cluster: packets dropped, both ways, between the
addresses of different groups (pods, the node), in a chain of our own that nothing else on the machine
uses.

The rules live in the `raw` table (chain PGHERD-PARTITION, jumped to first from PREROUTING and OUTPUT):
raw is traversed before connection tracking, so an established connection (a replication stream, the
operator's kept-alive connection to an agent) goes silent too, as in a real partition, rather than
being let through by the ESTABLISHED rules kube-proxy and kube-router put in the filter table. Pod to
pod traffic crosses PREROUTING on the bridge (bridge-nf-call-iptables is on: host.py); traffic from the
node to a pod leaves by OUTPUT, traffic from a pod to the node arrives by PREROUTING. A dropped packet
is silence: no reset, no ICMP error. `heal()` removes the chain and its jumps, and `down` calls it."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterable, Sequence

from e2e.localkube.binaries import host_tool

CHAIN = "PGHERD-PARTITION"
HOOKS = ("PREROUTING", "OUTPUT")


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [host_tool("iptables"), "-w", "5", "-t", "raw", *args],
        capture_output=True, text=True, timeout=30, check=check,
    )  # fmt: skip


def _exists() -> bool:
    return _iptables("-nL", CHAIN, check=False).returncode == 0


def pairs(groups: Sequence[Iterable[str]]) -> list[tuple[str, str]]:
    """Every (source, destination) address pair that crosses from one group to another, both ways."""
    sets = [sorted(set(group)) for group in groups]
    for a, b in itertools.combinations(range(len(sets)), 2):
        shared = set(sets[a]) & set(sets[b])
        if shared:
            raise ValueError(f"{sorted(shared)} in two groups")
    found: list[tuple[str, str]] = []
    for a, b in itertools.permutations(range(len(sets)), 2):
        found += [(x, y) for x in sets[a] for y in sets[b]]
    return found


def partition(groups: Sequence[Iterable[str]]) -> list[tuple[str, str]]:
    """Cut every group of addresses off from every other (an address in no group is left alone); a new
    partition replaces the one in place. The pairs cut."""
    cut = pairs(groups)
    if not _exists():
        _iptables("-N", CHAIN)
    _iptables("-F", CHAIN)
    for source, destination in cut:
        _iptables("-A", CHAIN, "-s", f"{source}/32", "-d", f"{destination}/32", "-j", "DROP")
    for hook in HOOKS:
        if _iptables("-C", hook, "-j", CHAIN, check=False).returncode != 0:
            _iptables("-I", hook, "1", "-j", CHAIN)
    return cut


def heal() -> None:
    """Every rule of ours gone (also when none is there)."""
    for hook in HOOKS:
        while _iptables("-D", hook, "-j", CHAIN, check=False).returncode == 0:
            pass
    if _exists():
        _iptables("-F", CHAIN)
        _iptables("-X", CHAIN)


def rules() -> list[str]:
    """The raw table's lines that name our chain: empty once healed."""
    listing = subprocess.run(
        [host_tool("iptables-save"), "-t", "raw"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return [line for line in listing.splitlines() if CHAIN in line]
