"""Malformed and mutated frames at a live server and scheduler while two good workers push_pull.

Counts (frames sent, connections, refusals) are printed; run with -s to see them.
"""

import gc
import os
import random
import socket
import struct
import threading
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.errors import GradwireError
from gradwire.protocol import frames
from gradwire.protocol.frames import FrameType
from gradwire.protocol.handshake import Handshake
from gradwire.testing import LocalCluster

FRAMES = int(os.environ.get("GRADWIRE_FUZZ_FRAMES", "10000"))


@given(st.binary(min_size=frames.HEADER_SIZE, max_size=frames.HEADER_SIZE))
def test_any_header_bytes_decode_or_raise_a_protocol_error(raw):
    try:
        frames.decode_header(raw, 1 << 20)
    except GradwireError:
        pass


@given(st.binary(max_size=256))
def test_any_body_decodes_or_raises_a_protocol_error(raw):
    try:
        frames.decode_json(raw)
    except GradwireError:
        pass


@settings(max_examples=300)
@given(
    st.dictionaries(
        st.sampled_from(["role", "rank", "nonce", "mac", "x"]),
        st.one_of(st.text(max_size=40), st.integers(), st.none(), st.binary(max_size=20).map(bytes.hex)),
    )
)
def test_any_handshake_message_is_refused_cleanly(body):
    hs = Handshake(secret=b"k", role="server", rank=0, initiator=False)
    for step in (hs.receive_hello, hs.receive_proof):
        try:
            step(body)
        except GradwireError:
            pass


def _mutations(rng: random.Random):
    """Frames a hostile or broken peer might send first: each a mutation of something valid."""
    hello = frames.encode_json(FrameType.HELLO, {"role": "worker", "rank": 0, "nonce": os.urandom(16).hex()})
    push = frames.encode_header(FrameType.PUSHPULL, 16, dtype=2, key=rng.getrandbits(64), round=1) + bytes(16)
    control = frames.encode_json(FrameType.CONTROL, {"op": "register", "role": "worker", "host": "h", "port": 1})
    while True:
        base = bytearray(rng.choice([hello, push, control]))
        kind = rng.randrange(6)
        if kind == 0:  # flip bits anywhere
            for _ in range(rng.randint(1, 8)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            base = base[: rng.randrange(len(base))]
        elif kind == 2:  # a huge or odd length field
            struct.pack_into("<Q", base, 32, rng.choice([2**64 - 1, 2**40, 1 << 20, 3, 0]))
        elif kind == 3:  # random type, dtype, flags
            base[5], base[6], base[7] = rng.randrange(256), rng.randrange(256), rng.randrange(256)
        elif kind == 4:  # random bytes of random length
            base = bytearray(os.urandom(rng.randrange(1, 200)))
        else:  # a valid header with a garbage body
            base = base[: frames.HEADER_SIZE] + os.urandom(rng.randrange(0, 64))
        yield bytes(base)


def _fuzz(targets, count, seed):
    rng, sent, errors = random.Random(seed), 0, 0
    gen = _mutations(rng)
    while sent < count:
        family, address = rng.choice(targets)
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(address)
                s.sendall(next(gen))
                sent += 1
        except OSError:
            errors += 1  # refused or reset: the peer dropped us, which is the point
            sent += 1
    return sent, errors


def test_fuzzing_a_live_job_crashes_nothing_and_changes_no_sum():
    with LocalCluster(num_workers=2, num_servers=1, secret="fuzz-secret", handshake_timeout=1.0) as c:
        host, port = c.scheduler.address.rsplit(":", 1)
        server = c.servers[0]
        targets = [
            (socket.AF_INET, (host, int(port))),
            (socket.AF_INET, ("127.0.0.1", server.port)),
            (socket.AF_UNIX, server.unix_name),
        ]
        stop, rounds, wrong = threading.Event(), [0], []

        def good(w):
            step = 0
            while True:
                # decide together whether to go on, so both workers leave after the same round
                if w.push_pull(np.array([stop.is_set()], np.int32), "fuzz-stop")[0]:
                    return True
                a = np.arange(5_000, dtype=np.int64) * (step + 1) + w.rank
                out = w.push_pull(a, "fuzz-target")
                if not np.array_equal(out, np.arange(5_000) * 2 * (step + 1) + 1):
                    wrong.append(step)
                step += 1
                if w.rank == 0:
                    rounds[0] = step

        workers = threading.Thread(target=lambda: c.run(good))
        workers.start()
        _fuzz(targets, 500, seed=0)  # warm up every refusal path before measuring
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        tracemalloc.start()
        sent, errors = _fuzz(targets, FRAMES // 2, seed=1)
        gc.collect()
        half, _ = tracemalloc.get_traced_memory()
        more, more_errors = _fuzz(targets, FRAMES - FRAMES // 2, seed=2)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        sent, errors = sent + more, errors + more_errors
        stop.set()
        workers.join(60)
        print(
            f"\nfuzz: {sent} frames on {sent} connections ({errors} refused at connect or reset), "
            f"{rounds[0]} good rounds meanwhile, server refusals {server.refusals.count}, "
            f"scheduler refusals {c.scheduler.refusals.count}, traced memory after each half {half} and {after} "
            f"bytes, threads {threads} -> {threading.active_count()}, fds {fds} -> {len(os.listdir('/proc/self/fd'))}"
        )
        assert not workers.is_alive() and not wrong
        assert rounds[0] > 0
        assert server.wait(0) is None and c.scheduler.abort_reason is None  # nobody crashed or aborted
        python = server.state.loop.alive and all(e.inline for e in server.engines)  # the loop runs the engine
        assert server.state.native.alive if server.state.native else python
        # a leak grows with the frames: the second half would add as much as the first
        assert after - half < 512 << 10, (half, after)
        assert threading.active_count() <= threads + 4 and len(os.listdir("/proc/self/fd")) <= fds + 8
        # and the job still works after the storm
        results = c.run(lambda w: w.push_pull(np.full(7, w.rank + 1, np.int32), "after-fuzz"))
        assert all(np.all(r == 3) for r in results)
