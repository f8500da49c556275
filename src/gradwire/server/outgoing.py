"""What a server's engines send its workers (a round's result, an acknowledgement, an error, that every worker has a
held sum), each through the worker's `Replier` (replier.py). On an engine's thread (or the link loop, where the one
engine runs inline) replies are held over each batch of the engine's ring and sent when the batch ends
(`HeldReplies`: one ACKS frame and one send per worker per batch); on any other thread they go at once. (What a
per-key operation may send is rounds.py's `Outbox`, which the engine hands it; this is what the outbox hands on to.)"""

from __future__ import annotations

from collections.abc import Callable

from gradwire.errors import GradwireError
from gradwire.protocol.frames import FrameType
from gradwire.server.replier import AckReply, ErrorReply, EveryoneReply, HeldReplies, ReplyItem, ResultReply
from gradwire.server.slot import Slot
from gradwire.server.staging import Countdown
from gradwire.server.state import ServerState
from gradwire.transport import tcp


class Outgoing:
    """What one server's engines send (module docstring). `held` is the batching the engines begin and flush."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.held = HeldReplies()

    def reply(
        self,
        key: int,
        rnd: int,
        dtype: int,
        payload: memoryview | list[memoryview],
        pulls: list[int],
        ranks: int,
        sent: Callable[[], None] | None = None,
        flags: int = 0,
    ) -> None:
        """A round's result to the workers in the bitmask `ranks` (each its slice where `payload` is a list; `pulls`:
        each one's shared-memory pull slot); `sent()` once every one of them has gone to its socket."""
        state = self.state
        if ranks == state.everyone:
            state.metrics.round_done()
        sliced = isinstance(payload, list)
        links, held = state.links, self.held
        to = [(rank, link) for rank in range(state.num_workers) if ranks >> rank & 1 and (link := links.get(rank))]
        countdown = Countdown(len(to), sent) if sent is not None and to else None
        for rank, link in to:
            item = ResultReply(key, rnd, dtype, payload[rank] if sliced else payload, pulls[rank], countdown, flags)
            held.reply(link, item)

    def ack(self, rank: int, key: int, rnd: int) -> None:
        """Worker `rank`'s contribution to round `rnd` of `key` is in."""
        self._hold_for(rank, AckReply(key, rnd))

    def everyone(self, rank: int, pairs: list[tuple[int, int]]) -> None:
        """Every worker answered has the sums of these held rounds (server/receipts.py): tell worker `rank`, behind
        the replies already held or queued for it."""
        link = self.state.links.get(rank)
        if link is not None:
            for key, rnd in pairs:
                link.hold(EveryoneReply(key, rnd))
            link.flush()

    def fail(self, slot: Slot, message: str) -> None:
        """The slot's contribution could not be summed: an ERROR for its key to its sender."""
        conn = slot.conn
        link = self.state.links.get(slot.sender)
        if link is not None and link.conn is conn:  # behind the replies to that worker held or queued (its ACKs)
            link.reply(ErrorReply(slot.key, message))
        elif isinstance(conn, tcp.Connection):
            try:
                conn.send_json(FrameType.ERROR, {"message": message}, key=slot.key)
            except GradwireError:
                pass

    def fail_rank(self, rank: int, key: int, message: str) -> None:
        """An ERROR for `key` to worker `rank` (a round that can never complete: engine.set_departed), behind the
        replies already queued for it (its ACK for that key among them)."""
        self._hold_for(rank, ErrorReply(key, message))

    def _hold_for(self, rank: int, item: ReplyItem) -> None:
        """`item` to worker `rank`, held over the batch (none if it is not connected)."""
        link = self.state.links.get(rank)
        if link is not None:
            self.held.reply(link, item)
