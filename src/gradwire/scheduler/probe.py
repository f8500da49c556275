"""GRADWIRE_PLACEMENT=auto: the scheduler measures every node's link during the rendezvous.

Between the last registration and the address book every node waits in `join()` (scheduler/client.py) and answers
probes. For each worker and dedicated server in turn, the scheduler asks it to send FRAMES PROBE frames of
FRAME_BYTES (its upload), then sends it as many (its download) and asks for the rate it saw. The first frame of
each burst is not timed: it absorbs TCP's slow start and a shaper's burst. A node's rate is the smaller of the
two directions, as the model (split.py) wants. Colocated servers share their worker host's link and are not
probed. Measuring against the scheduler assumes its own link is at least as fast as any node's; on a cluster
where it is not, give the rates instead (GRADWIRE_LINK_RATE).
"""

from __future__ import annotations

import time

from gradwire.errors import GradwireError
from gradwire.protocol import messages
from gradwire.protocol.frames import FrameType, encode_header
from gradwire.scheduler.node import Node, Probe
from gradwire.scheduler.placing import host_of

FRAMES = 9
FRAME_BYTES = 128 * 1024
_PAYLOAD = bytes(FRAME_BYTES)


PINGS = 3  # round trips timed before the bursts; the fastest is the node's RTT


def round_trip(node: Node, timeout: float) -> float:
    """The node's round-trip time to the scheduler, in seconds: the fastest of PINGS small control exchanges."""
    probe = node.probe = Probe(FRAMES)
    best = float("inf")
    for _ in range(PINGS):
        probe.pong.clear()
        sent = time.monotonic()
        node.conn.send_message(messages.Probe(ping=True))
        if not probe.pong.wait(timeout):
            raise GradwireError(f"{node.role} {node.rank} did not answer a ping in {timeout}s")
        best = min(best, time.monotonic() - sent)
    node.probe = None
    return best


def measure(node: Node, timeout: float) -> float:
    """The node's link rate in bytes per second: min(upload, download) as seen over the control connection."""
    probe = node.probe = Probe(FRAMES)
    node.conn.send_message(messages.Probe(send=FRAMES, bytes=FRAME_BYTES))
    if not probe.up_done.wait(timeout):
        raise GradwireError(f"{node.role} {node.rank} did not send its probe in {timeout}s")
    up = rate(probe.arrivals)
    header = encode_header(FrameType.PROBE, FRAME_BYTES)
    for _ in range(FRAMES):
        node.conn.send([header, _PAYLOAD])
    node.conn.send_message(messages.Probe(report=True))
    if not probe.down_done.wait(timeout):
        raise GradwireError(f"{node.role} {node.rank} did not report its probe in {timeout}s")
    node.probe = None
    return min(up, probe.down)


def measure_links(nodes: list[Node], timeout: float, known: dict[str, float] | None = None) -> dict[str, float]:
    """Measure the link of each of `nodes` (each waits for its address book and answers probes), one after the other,
    once per host: a worker on a host measured already (here, or in `known`: host -> rate) shares that host's link.
    Sets each node's `link_rate` (and `rtt` where probed); returns the rate of every host measured. Raises
    GradwireError naming a node that does not answer within `timeout`."""
    hosts = dict(known or {})
    measured: dict[str, float] = {}
    for node in nodes:
        key = host_of(node)
        if node.role == "worker" and key in hosts:  # another worker on a measured host: same link
            node.link_rate = hosts[key]
            continue
        node.probe_buffer = bytearray(FRAME_BYTES)
        node.rtt = round_trip(node, timeout)
        node.link_rate = hosts[key] = measured[key] = measure(node, timeout)
        node.probe_buffer = bytearray()
    return measured


def rate(arrivals: list[float]) -> float:
    """Bytes per second over the frames after the first (the first only starts the clock)."""
    elapsed = arrivals[-1] - arrivals[0]
    return (len(arrivals) - 1) * FRAME_BYTES / elapsed if elapsed > 0 else float("inf")
