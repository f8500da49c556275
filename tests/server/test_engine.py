import numpy as np
import pytest

from gradwire.protocol import dtypes, frames
from gradwire.protocol.frames import REPLAY, REPLICA, SEED, SHM_PAYLOAD
from gradwire.ring import Ring
from gradwire.server.engine import Engine
from gradwire.server.reader import landing_of
from gradwire.server.slot import Slot


def _engine(replies, acks, fails, workers=2, deterministic=True):
    return Engine(
        0,
        Ring(4, 64, Slot),
        workers,
        lambda *a: replies.append((*a[:4], [bytes(p) for p in a[3]] if isinstance(a[3], list) else bytes(a[3]), a[5])),
        lambda s, m: fails.append(m),
        lambda *a: acks.append(a),
        deterministic=deterministic,
    )


def _push(engine, sender, data, key=9, rnd=1, flags=0, land=False):
    """One contribution as a reader hands it over; `land`: received over a socket where the reader puts it
    (server/reader.py's `landing_of`: the key's landing buffer with deterministic sums, else the ring slot's own
    memory); else lying where it is, as in a worker's shared push slot."""
    code, raw = dtypes.from_numpy(data.dtype).code, np.ascontiguousarray(data).view(np.uint8)
    slot = Slot(memoryview(bytearray(raw.nbytes)), np.empty(raw.nbytes, np.uint8))
    slot.data = raw
    if land:
        header = frames.Header(frames.FrameType.PUSHPULL, flags, code, 0, sender, key, rnd, 0, raw.nbytes)
        landing_of(engine, slot, header)[:] = raw
    slot.key, slot.round, slot.dtype, slot.length = key, rnd, code, raw.nbytes
    slot.sender, slot.flags = sender, flags
    engine.on_event(slot)


def test_frames_are_checked_against_the_declaration_before_a_slot_is_taken():
    engine = _engine([], [], [])
    assert "not declared" in engine.check(7, 2, 16)
    engine.declare(7, dtypes.BY_NAME["float32"], 16)
    assert engine.check(7, 2, 16) is None
    assert "16 bytes of float32" in engine.check(7, 2, 8)
    assert "16 bytes of float32" in engine.check(7, 3, 16)
    engine.declare(7, dtypes.BY_NAME["float64"], 64)  # a redeclaration changes nothing
    assert engine.check(7, 2, 16) is None


def test_a_round_completes_with_every_worker_and_acks_the_others():
    replies, acks, fails = [], [], []
    engine = _engine(replies, acks, fails)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    for sender, value in ((0, 1.0), (1, 2.0)):
        slot = engine.ring.slots[sender]
        slot.data = np.full(4, value, np.float32).view(np.uint8)
        slot.key, slot.round, slot.dtype, slot.length, slot.sender = 9, 1, 2, 16, sender
        engine.on_event(slot)
    assert acks == [(0, 9, 1)] and not fails
    key, rnd, dtype, _, payload, _ = replies[0]
    assert (key, rnd, dtype) == (9, 1, 2)
    assert list(np.frombuffer(payload, np.float32)) == [3.0] * 4


def _sum_in_order(order, contributions, deterministic=True, flags=0, land=False):
    replies = []
    engine = _engine(replies, [], [], workers=len(contributions), deterministic=deterministic)
    engine.declare(9, dtypes.BY_NAME["float32"], contributions[0].nbytes)
    for rank in order:
        _push(engine, rank, contributions[rank].copy(), flags=flags, land=land)
    assert len(replies) == 1 and replies[0][5] == (1 << len(contributions)) - 1
    return replies[0][4]


@pytest.mark.parametrize(
    "flags,land", [(0, False), (0, True), (SHM_PAYLOAD, False)], ids=["ring-slot", "landed", "shared-memory"]
)
def test_sums_are_bit_identical_whatever_the_arrival_order(flags, land):
    rng = np.random.default_rng(5)
    # magnitudes far apart, so the order of additions changes the rounding
    contributions = [(rng.standard_normal(512) * 10.0 ** rng.integers(-6, 7, 512)).astype(np.float32) for _ in range(5)]
    orders = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3], [1, 2, 3, 4, 0], [3, 4, 0, 2, 1]]
    sums = {_sum_in_order(order, contributions, flags=flags, land=land) for order in orders}
    assert len(sums) == 1
    expected = contributions[0].copy()
    for c in contributions[1:]:
        expected += c
    assert sums == {expected.tobytes()}
    # arrival order does change the bits when the engine adds as things come (the reason for the default)
    assert len({_sum_in_order(order, contributions, deterministic=False) for order in orders}) > 1


def test_a_seed_completes_a_round_and_answers_its_pushers_before_and_after():
    replies, acks = [], []
    engine = _engine(replies, acks, [], workers=3)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    total = np.arange(4, dtype=np.float32) * 7
    _push(engine, 1, np.ones(4, np.float32), rnd=5)  # worker 1 never got round 5's sum from the dead server
    _push(engine, 0, total, rnd=5, flags=SEED)  # worker 0 did: the round is complete, worker 1 is answered
    assert [(r[1], r[5]) for r in replies] == [(5, 0b010)] and replies[0][4] == total.tobytes()
    _push(engine, 2, np.ones(4, np.float32), rnd=5)  # worker 2's push arrives after the seed: answered alone
    assert [(r[1], r[5]) for r in replies[1:]] == [(5, 0b100)] and replies[1][4] == total.tobytes()
    _push(engine, 2, total * 2, rnd=5, flags=SEED)  # a second seed of a complete round changes nothing
    _push(engine, 1, total, rnd=3, flags=SEED)  # nor does a seed of a round this buffer has moved past
    assert len(replies) == 2
    for rank in range(3):  # the next rounds go on as usual
        _push(engine, rank, np.full(4, rank, np.float32), rnd=6)
        _push(engine, rank, np.full(4, rank, np.float32), rnd=7)
    assert [(r[1], r[5]) for r in replies[2:]] == [(6, 0b111), (7, 0b111)]
    assert replies[3][4] == np.full(4, 3, np.float32).tobytes()


def test_an_early_contribution_in_shared_memory_is_copied_and_acknowledged_at_once():
    # acknowledged at once, so the worker's window never fills with contributions waiting for other workers (which
    # deadlocked workers whose hooks submit keys in different orders); copied first, so the slot may be reused
    replies, acks = [], []
    engine = _engine(replies, acks, [], workers=3)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    slot2 = np.full(4, 2.0, np.float32)  # stands for worker 2's shared push slot
    _push(engine, 2, slot2, flags=SHM_PAYLOAD)
    assert acks == [(2, 9, 1)]
    slot2[:] = 5.0  # the worker reuses its slot: the staged copy is what gets added
    _push(engine, 1, np.full(4, 1.0, np.float32), flags=SHM_PAYLOAD)
    assert acks == [(2, 9, 1), (1, 9, 1)]
    _push(engine, 0, np.full(4, 0.5, np.float32), flags=SHM_PAYLOAD)  # completes: 0.5 + 1 + 2, RESULT to all
    assert len(acks) == 2 and replies[0][4] == np.full(4, 3.5, np.float32).tobytes()


def test_the_scheduler_asks_one_holder_to_seed_each_round_a_worker_still_waits_for():
    from gradwire.scheduler.failover import seeds_needed

    # key 7: worker 2 resends round 5, workers 0 and 1 hold its sum (and resend round 6): one seed, from worker 0.
    # key 8: everyone resends round 3, nobody has its sum: nothing to seed. key 9: everyone has round 4: nothing.
    reported = {
        0: {7: (5, 6, False), 8: (2, 3, False), 9: (4, -1, False)},
        1: {7: (5, 6, False), 8: (2, 3, False), 9: (4, -1, False)},
        2: {7: (4, 5, False), 8: (2, 3, False), 9: (4, -1, False)},
    }
    assert seeds_needed(reported) == {0: [[7, 5]]}
    # a sliced key (reducescatter): workers 0 and 2 hold only their contributions to round 5, worker 1 resends its
    # push: both replay theirs, or the round can never complete again
    sliced = {0: {7: (5, 6, True)}, 1: {7: (4, 5, False)}, 2: {7: (5, -1, True)}}
    assert seeds_needed(sliced) == {0: [[7, 5]], 2: [[7, 5]]}


def test_replayed_contributions_complete_a_sliced_round_and_only_the_waiting_ranks_are_answered():
    replies, acks = [], []
    engine = _engine(replies, acks, [], workers=3)
    engine.declare(9, dtypes.BY_NAME["float32"], 24, slices=[(0, 8), (8, 8), (16, 8)])
    parts = [np.arange(6, dtype=np.float32) * 10.0 ** (2 * r) for r in range(3)]
    # the dead server answered workers 0 and 2 their slices of round 5; worker 1 resends its push, the others replay
    _push(engine, 2, parts[2].copy(), rnd=5, flags=REPLAY)
    _push(engine, 1, parts[1].copy(), rnd=5)
    assert not replies and acks == [(1, 9, 5)]  # worker 1's push is acknowledged, a replay never is
    _push(engine, 0, parts[0].copy(), rnd=5, flags=REPLAY)
    ((key, rnd, _, _, payload, ranks),) = replies
    assert (key, rnd, ranks) == (9, 5, 0b010)  # only worker 1 is answered: its slice of the rank-order sum
    assert bytes(payload[1]) == ((parts[0] + parts[1]) + parts[2])[2:4].tobytes()
    _push(engine, 0, parts[0].copy(), rnd=5, flags=REPLAY)  # asked again (a second failover): dropped
    _push(engine, 2, parts[2].copy(), rnd=3, flags=REPLAY)  # a round this buffer has moved past: dropped
    assert len(replies) == 1
    for rank in range(3):  # the next round goes on as usual, answered to everyone
        _push(engine, rank, parts[rank].copy(), rnd=7)
    assert replies[1][1] == 7 and replies[1][5] == 0b111


def test_a_contribution_lands_in_its_key_buffer_only_where_it_may_wait():
    engine = _engine([], [], [], workers=3)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    assert engine.landing(9, 1, 0) is None  # rank 0 is never early; no round has completed yet (see below)
    assert engine.landing(8, 1, 1) is None  # not declared
    a, b = engine.landing(9, 1, 2), engine.landing(9, 2, 2)
    assert a.nbytes == b.nbytes == 16 and not np.shares_memory(a, b)  # one per round buffer
    assert np.shares_memory(a, engine.landing(9, 3, 2))  # allocated once, reused two rounds later
    off = _engine([], [], [], workers=3, deterministic=False)
    off.declare(9, dtypes.BY_NAME["float32"], 16)
    assert off.landing(9, 1, 2) is None  # sums as things come: no staging at all


def test_the_first_rank_lands_in_the_accumulator_once_rounds_complete_and_never_over_a_round_in_use():
    """Rank 0's contribution (added first) is received straight into the round's accumulator, saving a copy: only
    once a round has completed from contributions (after a failover a seed may be written there meanwhile), and
    never into a buffer whose round is in use (unfinished, complete, or seeded)."""
    replies = []
    engine = _engine(replies, [], [], workers=3)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    state = engine.keys[9]
    for rank in (2, 1, 0):
        _push(engine, rank, np.full(4, rank + 1, np.float32), rnd=1, land=True)
    assert len(replies) == 1  # round 1 complete: from now on rank 0 lands
    into = engine.landing(9, 3, 0)
    assert into is not None and np.shares_memory(into, state.rounds[1].acc)
    assert engine.landing(9, 2, 0) is not None and np.shares_memory(engine.landing(9, 2, 0), state.rounds[0].acc)
    _push(engine, 1, np.full(4, 2, np.float32), rnd=3, land=True)  # round 3 begun, rank 0's part not in: may land
    assert engine.landing(9, 3, 0) is not None
    assert engine.landing(9, 5, 0) is None  # another round while 3 is unfinished (a misbehaving worker)
    _push(engine, 0, np.full(4, 1, np.float32), rnd=3, land=True)
    assert engine.landing(9, 3, 0) is None  # rank 0 pushed round 3 already
    _push(engine, 2, np.full(4, 3, np.float32), rnd=3, land=True)
    assert engine.landing(9, 3, 0) is None  # round 3 complete: its sum is being answered from there
    assert replies[-1][1] == 3 and replies[-1][4] == np.full(4, 6, np.float32).tobytes()
    # a seeded round's sum lies in the accumulator: a push of it is answered from there, never landed on
    _push(engine, 1, np.arange(4, dtype=np.float32) * 7, rnd=4, flags=SEED)
    assert engine.landing(9, 4, 0) is None
    # narrowed sums (float16 in float32) add the first contribution by widening it: nothing lands
    engine.declare(11, dtypes.BY_NAME["float16"], 8)
    for rank in range(3):
        _push(engine, rank, np.ones(4, np.float16), key=11, rnd=1)
    assert engine.landing(11, 3, 0) is None and engine.landing(11, 3, 1) is not None


def test_sums_stay_bit_identical_over_rounds_with_the_first_rank_landed():
    rng = np.random.default_rng(7)
    replies = []
    engine = _engine(replies, [], [], workers=4)
    engine.declare(9, dtypes.BY_NAME["float32"], 2048)
    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2], [0, 3, 1, 2], [3, 0, 2, 1]]
    for rnd, order in enumerate(orders, start=1):
        parts = [(rng.standard_normal(512) * 10.0 ** rng.integers(-6, 7, 512)).astype(np.float32) for _ in range(4)]
        for rank in order:
            _push(engine, rank, parts[rank].copy(), rnd=rnd, land=True)
        expected = parts[0].copy()
        for p in parts[1:]:
            expected += p
        assert replies[-1][1] == rnd and replies[-1][4] == expected.tobytes(), rnd
    assert engine.keys[9].landable


MIB = 1 << 20  # keys of this size have their buffers lent (rounds.LEND_BYTES)


def test_buffers_are_lent_by_the_pool_one_per_key_between_rounds_at_most():
    """Staging buffers go back to the engine's pool once their contribution is added, and a round's buffer at the
    latest once the key's next round completes (here no reply says it was sent): a key holds one buffer between
    rounds, not two round buffers and (workers - 1) x 2 staging buffers. Small keys keep buffers of their own."""
    replies = []
    engine = _engine(replies, [], [], workers=3)
    keys = range(10, 20)
    for key in keys:
        engine.declare(key, dtypes.BY_NAME["float32"], MIB)
    engine.declare(7, dtypes.BY_NAME["float32"], 4096)
    for rnd in (1, 2, 3):
        for key in [*keys, 7]:
            for rank in (2, 0, 1):  # rank 2 early: it waits in a staging buffer
                value = np.full(engine.keys[key].length // 4, rank + rnd, np.float32)
                _push(engine, rank, value, key=key, rnd=rnd, land=True)
    sums = [np.full(MIB // 4, 3 * rnd + 3, np.float32).tobytes() for rnd in (1, 2, 3)]
    large = [r[4] for r in replies if r[0] != 7]
    assert large == [sums[0]] * 10 + [sums[1]] * 10 + [sums[2]] * 10
    assert [sum(r.acc is not None for r in engine.keys[k].rounds) for k in keys] == [1] * 10
    assert engine.pool.allocated <= (10 + 3) * MIB + 2 * 2 * 4096  # against (2 + 2 x 2) x 10 MiB owned per key
    assert all(r.acc is not None for r in engine.keys[7].rounds)  # a small key's own


def test_a_rounds_result_stays_until_every_worker_has_pushed_the_next_round():
    """A lent buffer goes back only when the key's next round completes: until then a worker may still be receiving
    the result, however many other keys' rounds come and go meanwhile."""
    results = []
    engine = Engine(
        0, Ring(4, 64, Slot), 2, lambda *a: results.append((a[1], a[3])), lambda s, m: None, lambda *a: None
    )
    engine.declare(9, dtypes.BY_NAME["float32"], MIB)
    engine.declare(8, dtypes.BY_NAME["float32"], MIB)
    count = MIB // 4
    for rank in (0, 1):
        _push(engine, rank, np.full(count, rank + 1, np.float32), key=9, rnd=1, land=True)
    (rnd, first), three = results[0], np.full(count, 3, np.float32).tobytes()
    _push(engine, 0, np.full(count, 5, np.float32), key=9, rnd=2, land=True)  # rank 1 may still be receiving round 1
    for rnd in range(1, 5):  # other keys' rounds take and give back buffers meanwhile
        for rank in (1, 0):
            _push(engine, rank, np.full(count, 7, np.float32), key=8, rnd=rnd, land=True)
    assert bytes(first) == three
    _push(engine, 1, np.full(count, 5, np.float32), key=9, rnd=2, land=True)
    assert bytes(results[-1][1]) == np.full(count, 10, np.float32).tobytes()


def _replica_forward(engine, key, rnd, data):
    """A forwarded result received as the replica's reader does: into its landing buffer."""
    slot = Slot(memoryview(bytearray(0)), np.empty(0, np.uint8))
    into = engine.replica_landing(key, rnd, data.nbytes)
    into[:] = data.view(np.uint8)
    slot.data, slot.landed = into, True
    slot.key, slot.round, slot.dtype, slot.length = key, rnd, dtypes.from_numpy(data.dtype).code, data.nbytes
    slot.sender, slot.flags, slot.conn = 0, REPLICA, None
    engine.on_event(slot)


def test_a_replica_keeps_one_buffer_per_key_and_its_owner_two_again():
    """A replica keeps only the last round its server answered: one buffer for both rounds (a forward of round r+1
    means every worker has r). Promoted to the key's owner, it answers the laggards of the last forwarded round from
    it, and sums the next round in a buffer of its own."""
    replies = []
    engine = _engine(replies, [], [], workers=2)
    engine.declare(9, dtypes.BY_NAME["float32"], 16)
    state = engine.keys[9]
    state.keep(True)
    assert state.rounds[0].acc is state.rounds[1].acc
    for rnd in (1, 2, 3):
        _replica_forward(engine, 9, rnd, np.full(4, rnd * 10, np.float32))
    assert engine.replicated == 3 and not replies
    state.keep(False)  # promoted: its server died after answering round 3 to some workers
    _push(engine, 1, np.full(4, 7, np.float32), rnd=3)  # a laggard's push of round 3: the seed answers it
    assert replies[-1][1] == 3 and replies[-1][4] == np.full(4, 30, np.float32).tobytes()
    assert state.rounds[0].acc is not state.rounds[1].acc
    for rank in (0, 1):  # round 4, in the other buffer: round 3's sum stays for whoever still asks
        _push(engine, rank, np.full(4, rank + 1, np.float32), rnd=4)
    assert replies[-1][1] == 4 and replies[-1][4] == np.full(4, 3, np.float32).tobytes()
    assert bytes(state.rounds[1].result) == np.full(4, 30, np.float32).tobytes()


def test_a_rounds_buffer_goes_back_once_its_replies_are_sent_unless_lent_again():
    """The repliers say when a round's replies are all sent (Reply's `sent`): its buffer goes back then, so keys hold
    no buffer between rounds. A reply thread that calls back late, after the round's buffer was lent again to a later
    round, releases nothing."""
    sent = []
    engine = Engine(0, Ring(4, 64, Slot), 2, lambda *a: sent.append(a[6]), lambda s, m: None, lambda *a: None)
    count = MIB // 4
    for key in (8, 9):
        engine.declare(key, dtypes.BY_NAME["float32"], MIB)
    for rank in (0, 1):
        _push(engine, rank, np.full(count, rank + 1, np.float32), key=9, rnd=1, land=True)
    state = engine.keys[9]
    assert state.rounds[1].acc is not None and sent[-1] is not None
    sent[-1]()  # every reply of round 1 sent
    assert state.rounds[1].acc is None and engine.pool.allocated == 2 * MIB  # the round's buffer and a staging one
    for rank in (0, 1):  # key 8 takes them from the pool: nothing new
        _push(engine, rank, np.full(count, 1, np.float32), key=8, rnd=1, land=True)
    assert engine.pool.allocated == 2 * MIB
    late = sent[-1]
    for rnd in (2, 3):  # key 8 goes on; its round 1's replies call back only once round 3 holds the same buffer
        for rank in (0, 1):
            _push(engine, rank, np.full(count, rnd, np.float32), key=8, rnd=rnd, land=True)
        if rnd == 2:
            sent[-1]()
    holder = engine.keys[8].rounds[1]
    assert holder.number == 3 and holder.acc is not None
    late()
    assert holder.acc is not None  # lent again since: kept
