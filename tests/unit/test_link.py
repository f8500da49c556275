"""A worker's link to one server, driven by hand over a socket pair (worker/link.py)."""

import socket
import time

import numpy as np

from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import FrameType
from gradwire.transport import tcp
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.work import Work


def test_an_answer_that_overtakes_the_senders_stamp_still_times_every_stage_from_the_push():
    """The server may answer before the sender thread has stamped the end of its send (a loaded machine): the
    partition's stages must still start at its push, not at time 0 (which put timeline events hours in the past and
    negative seconds into the stage histogram)."""
    ours, theirs = socket.socketpair()
    link = ServerLink(tcp.Connection(ours, 1 << 20), server=0, rank=0, epoch=1, window=4, credit=Credit(1 << 20))
    out = np.zeros(4, np.float32)
    handle = Handle("t", out, 1, lambda h: None)
    work = Work("t", 7, 1, dtypes.from_numpy(out.dtype).code, out, out, 1, handle)
    work.t_queued = work.t_sent = time.monotonic()  # taken by the sender, whose send has not returned yet
    link.flow.pending[7], link.flow.in_flight = work, 1
    header = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(header, FrameType.RESULT, out.nbytes, work.dtype, 1, 0, 7, 1)
    theirs.sendall(bytes(header) + np.full(4, 2, np.float32).tobytes())
    link._on_result(link.conn.recv_header())
    assert handle.wait(1.0).tolist() == [2.0] * 4
    assert work.t_pushed >= work.t_sent
    assert min(link.metrics._seconds) >= 0.0 and link.metrics.bytes_pulled == out.nbytes
    ours.close()
    theirs.close()


def test_the_stage_histogram_and_counters_read_as_prometheus_did():
    """Counted as plain numbers on the data path, exposed in prometheus_client's types when /metrics is read."""
    from prometheus_client.parser import text_string_to_metric_families

    from gradwire.admin.metrics import Metrics

    metrics = Metrics("worker")
    metrics.pushed(100)
    metrics.partition(64, 0.0001, 0.002, 0.002, 20.0)  # queued, push, wait, pull
    metrics.partition(64, 0.0001, 0.0005, 0.5, 0.001)
    metrics.round_done()
    status, _, body = metrics.exposition()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("gradwire_pushed_bytes_total", (("role", "worker"),))] == 100
    assert samples[("gradwire_pulled_bytes_total", (("role", "worker"),))] == 128
    assert samples[("gradwire_rounds_completed_total", (("role", "worker"),))] == 1
    bucket = "gradwire_partition_stage_seconds_bucket"
    assert samples[(bucket, (("le", "0.0005"), ("stage", "push")))] == 1  # an upper bound includes its value
    assert samples[(bucket, (("le", "0.0025"), ("stage", "push")))] == 2  # cumulative
    assert (
        samples[(bucket, (("le", "10.0"), ("stage", "pull")))] == 1
        and samples[(bucket, (("le", "+Inf"), ("stage", "pull")))] == 2
    )
    assert samples[("gradwire_partition_stage_seconds_count", (("stage", "wait"),))] == 2
    assert abs(samples[("gradwire_partition_stage_seconds_sum", (("stage", "wait"),))] - 0.502) < 1e-9
    assert status == 200 and "gradwire_partition_stage_seconds" not in Metrics("server").exposition()[2].decode()
