"""An emulated cluster on one machine: a network namespace per host on a bridge, links shaped by tc."""

from gradwire.netem.cluster import EmulatedCluster, NetemUnavailable
from gradwire.netem.topology import Host, Topology, parse_rate

__all__ = ["EmulatedCluster", "Host", "NetemUnavailable", "Topology", "parse_rate"]
