"""Held keys: the server's receipts (server/receipts.py) and a worker link's held partitions (worker/holding.py),
driven by hand."""

import socket

import numpy as np
import pytest

from gradwire.errors import RemoteProtocolError
from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import FrameType
from gradwire.server.receipts import Receipts
from gradwire.transport import tcp
from gradwire.worker.credit import Credit
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.work import Work


def _receipts():
    told: list[tuple[int, list]] = []
    return Receipts(lambda rank, pairs: told.append((rank, pairs))), told


def test_every_worker_answered_is_told_once_all_have_the_sum():
    receipts, told = _receipts()
    receipts.expect(7, 3, 0b111)
    receipts.expect(8, 3, 0b011)
    receipts.received(0, [(7, 3), (8, 3)])
    receipts.received(2, [(7, 3)])
    assert told == []
    receipts.received(1, [(8, 3), (7, 3)])
    assert sorted(told) == [(0, [(8, 3), (7, 3)]), (1, [(8, 3), (7, 3)]), (2, [(7, 3)])]
    assert len(receipts) == 0


def test_a_seeded_round_waits_for_each_pusher_it_answers_later():
    """After a failover a seeded round answers its pushers one at a time: each joins those waited for."""
    receipts, told = _receipts()
    receipts.expect(7, 3, 0b010)
    receipts.expect(7, 3, 0b100)
    receipts.received(1, [(7, 3)])
    assert told == []
    receipts.received(2, [(7, 3)])
    assert sorted(told) == [(1, [(7, 3)]), (2, [(7, 3)])]


def test_a_receipt_of_a_round_not_answered_or_said_twice_is_refused():
    receipts, _ = _receipts()
    receipts.expect(7, 3, 0b011)
    with pytest.raises(RemoteProtocolError, match="worker 2 says it received round 3"):
        receipts.received(2, [(7, 3)])
    receipts.received(0, [(7, 3)])
    with pytest.raises(RemoteProtocolError, match="said so already"):
        receipts.received(0, [(7, 3)])
    with pytest.raises(RemoteProtocolError):
        receipts.received(1, [(7, 4)])


def test_workers_that_leave_are_not_waited_for_nor_told():
    receipts, told = _receipts()
    receipts.expect(7, 3, 0b111)
    receipts.received(0, [(7, 3)])
    receipts.depart(0b100)
    assert told == []
    receipts.received(1, [(7, 3)])
    assert sorted(told) == [(0, [(7, 3)]), (1, [(7, 3)])]
    receipts.expect(9, 1, 0b11)
    receipts.received(0, [(9, 1)])
    receipts.depart(0b110)  # the last one waited for left: the others are told at once
    assert told[-1] == (0, [(9, 1)])
    receipts.expect(9, 2, 0b11)
    receipts.reset()
    assert len(receipts) == 0


def test_entry_frames_torn_are_refused():
    body = b"".join(frames.ACK_ENTRY.pack(key, 7) for key in range(3))
    for kind in (FrameType.RECEIVED, FrameType.EVERYONE):
        assert frames.decode_header(frames.encode_header(kind, len(body)), 0).length == len(body)
        with pytest.raises(RemoteProtocolError, match=f"{kind.name} body of 35 bytes"):
            frames.decode_header(frames.encode_header(kind, len(body) - 1), 0)


def _held_link(out: np.ndarray, send: np.ndarray, average: int = 1):
    ours, theirs = socket.socketpair()
    seeds: dict = {}
    link = ServerLink(
        tcp.Connection(ours, 1 << 20), server=0, rank=0, epoch=1, window=4, credit=Credit(1 << 20), seeds=seeds
    )
    handle = Handle("t", out, 1, lambda h: None)
    work = Work("t", 7, 1, dtypes.from_numpy(out.dtype).code, send, out, average, handle, partial=True)
    work.held = True
    link.flow.pending[7], link.flow.in_flight = work, 1
    return link, theirs, handle, work, seeds


def _result(theirs: socket.socket, payload: np.ndarray, cut: int | None = None, flags: int = 0) -> None:
    header = bytearray(frames.HEADER_SIZE)
    frames.pack_header_into(header, FrameType.RESULT, payload.nbytes, 1, 1, 0, 7, 1, flags)
    theirs.sendall(bytes(header) + payload.tobytes()[:cut])


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
def test_a_held_sum_stays_in_the_output_as_the_seed_until_everyone_has_it(in_place):
    out = np.arange(8, dtype=np.float32)
    send = out if in_place else out.copy()
    link, theirs, handle, work, seeds = _held_link(out, send, average=2)
    _result(theirs, np.full(8, 6.0, np.float32))
    link._read_frames()
    assert not handle.done()
    assert out.tolist() == [3.0] * 8  # averaged as it came in: the seed says so (frames.AVERAGED)
    assert seeds[7].held and seeds[7].averaged and seeds[7].round == 1 and np.shares_memory(seeds[7].data, out)
    assert link.holds.receipts == [(7, 1)]  # the sender's next frame says so
    with pytest.raises(RemoteProtocolError, match="does not hold"):
        link._on_everyone(frames.ACK_ENTRY.pack(7, 2))
    link._on_everyone(frames.ACK_ENTRY.pack(7, 1))
    assert handle.wait(1.0).tolist() == [3.0] * 8
    assert 7 not in seeds and len(link.holds) == 0
    link.conn.close()
    theirs.close()


def test_a_sum_seeded_averaged_is_taken_as_it_is_and_only_by_a_held_key():
    """After a failover a held key's seed may come from an averaging call's output: the new server answers with
    AVERAGED, and the workers copy it without dividing again (the same bits the holder has)."""
    out = np.zeros(8, np.float32)
    link, theirs, handle, work, seeds = _held_link(out, out.copy(), average=3)
    _result(theirs, np.full(8, 1 / 3, np.float32), flags=frames.AVERAGED)
    link._read_frames()
    assert out.tobytes() == np.full(8, 1 / 3, np.float32).tobytes() and seeds[7].averaged
    link.conn.close()
    theirs.close()
    link, theirs, handle, work, seeds = _held_link(out, out.copy(), average=3)
    work.held = False
    _result(theirs, np.ones(8, np.float32), flags=frames.AVERAGED)
    with pytest.raises(RemoteProtocolError, match="not held, with an averaged sum"):
        link._read_frames()
    link.conn.close()
    theirs.close()


def test_an_in_place_held_sum_cut_off_mid_frame_leaves_the_contribution_whole():
    """The server dies while sending: the worker pushes its contribution again, so it must not be half overwritten
    (it is received into a buffer of one partition first, then copied)."""
    out = np.arange(1 << 16, dtype=np.float32)
    link, theirs, handle, work, seeds = _held_link(out, out)
    _result(theirs, np.full(1 << 16, -1.0, np.float32), cut=100_000)
    theirs.close()
    with pytest.raises(tcp.ConnectionClosed):
        for _ in range(3):  # each as the link loop calls it, the socket readable: what came, then the end
            link._read_frames()
    assert out.tolist() == list(range(1 << 16))
    assert not handle.done() and 7 not in seeds
    link.conn.close()


def test_a_closed_link_fails_the_calls_it_holds():
    out = np.zeros(4, np.float32)
    link, theirs, handle, work, seeds = _held_link(out, out.copy())
    _result(theirs, np.ones(4, np.float32))
    link._read_frames()
    link.close(RemoteProtocolError("gone"))
    with pytest.raises(RemoteProtocolError, match="gone"):
        handle.wait(1.0)
    assert 7 not in seeds
    theirs.close()
