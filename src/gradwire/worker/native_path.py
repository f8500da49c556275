"""The worker's data path in native code (gradwire-native's `WorkerLoop`, native/cpp/loop.hpp): where it applies, one
loop thread owns every link (its socket, and a same-host link's shared slots) for the links' life, after Python's
connect, handshake and authentication, and moves every call's partitions by the worker's rule (flow control, credit,
pacing); Python submits each call and completes its handle (worker/state.py's `DataPath`).

A call hands the loop its plan: for a plain call (a reduction, a gather, a reduce-scatter: bytes in, bytes out) the
partitions' offsets in the caller's input and output, cut once per tensor and cut and cached (`_plan`); the loop
pushes from the input and receives each sum straight into the output. A call with a Python step per partition (a
compressed block decoded into the output, a server-side update's trailer) hands over its partitions' own buffers
(`Work`, as the Python path cuts them) and the step runs once the call's answers are all in. One thread drains the
loop's completions: an average is divided there (numpy's rounding: the Python path's bytes), the metrics counted,
and the handle completes or fails with the error the Python path would raise (a server's refusal: TensorError; a
lost server: JobAborted; a server's abort: abort_error's).

Server failover (docs/faults.md) runs through it too: the loop keeps each key's last answered round (the sum received
into the key's seed and copied out, or a sliced round's contribution), keeps a dead server's parts when its socket
closes and says so (call 0's completion), and worker/failover.py moves them (`detach`, `replace`, `reroute`) and sends
the seeds the scheduler asks for (`push_seed`), as it does a Python link's.

A held key's partition (worker/holding.py) is pushed flagged HELD; the loop receives its sum into the output and
holds it there (the key's seed), the part unanswered, saying so to the server (RECEIVED) until it answers that every
worker has it (EVERYONE). An average is divided once the call completes, so a held output is the round's sum: a seed
sent from it is a plain SEED, which its receivers divide as they divide any sum (the Python path holds the average
and sends it flagged AVERAGED; the same bits either way).

With a timeline on (GRADWIRE_TIMELINE, `Worker.start_timeline`), the loop keeps each answered partition's four
stages and the drainer writes them before the call completes, as the Python path's answers.py does.

Where it applies (`why_not`): gradwire-native loads under GRADWIRE_DATAPATH and no server's place is a lost one's.
Anywhere else the Python path runs, as before. What runs where: docs/native.md.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from gradwire import native
from gradwire.admin.metrics import BUCKETS
from gradwire.errors import GradwireError, JobAborted, RemoteProtocolError, TensorError, abort_error
from gradwire.transport.tcp import ConnectionClosed
from gradwire.worker.credit import PACE_GIVE_UP_SECONDS
from gradwire.worker.flow import LIVENESS_SECONDS
from gradwire.worker.handle import Handle
from gradwire.worker.link import ServerLink
from gradwire.worker.lost_link import LostLink
from gradwire.worker.state import SHUTDOWN_JOIN_SECONDS, WorkerState
from gradwire.worker.tensors import Tensor
from gradwire.worker.work import Transfer, Work, stages

log = logging.getLogger("gradwire.worker")
DRAIN_SECONDS = 0.5  # how long the drainer waits for a completion before it looks whether it should stop
LEND_SECONDS = 10.0  # how long a link may take to leave the Python loop when it is lent

REFUSED = re.compile(r"worker (\d+): server (\d+) refused (.*) \(key (\d+)\): (\{.*\})", re.S)
ENDED = re.compile(r"server (\d+) ended the job: (\{.*\})", re.S)
LINK = re.compile(r"server (\d+): (protocol error: )?(.*)", re.S)
LINK_LOST = 0  # the call number of the loop's completions that say a link was lost (failover on)
# what a part keeps of its answered round (the loop's `keep`): nothing, the sum, its contribution, or the sum held in
# the output until every worker has it (a held key's, worker/holding.py)
KEEP_NOTHING, KEEP_SUM, KEEP_CONTRIBUTION, KEEP_HELD = 0, 1, 2, 3


def refusal(tensor: str, error: str) -> TensorError | None:
    """A server's refusal of `tensor` as the native loop words it, as the Python path says it (worker/answers.py);
    None for any other error."""
    refused = REFUSED.fullmatch(error)
    if refused is None:
        return None
    rank, server, _, key, body = refused.groups()
    return TensorError(
        f"server {server} refused {tensor!r} (key {int(key):016x}): {json.loads(body).get('message')}",
        tensor=tensor,
        server=int(server),
        rank=int(rank),
    )


def why_not(state: WorkerState, links: list[ServerLink | LostLink]) -> str:
    """Why the native path does not apply to a worker with `links` ("" where it does)."""
    if native.for_datapath(state.config.datapath) is None:
        return f"GRADWIRE_DATAPATH={state.config.datapath}" if state.config.datapath == "python" else "no native build"
    if not links:
        return "no links"
    lost = [link.server for link in links if not isinstance(link, ServerLink)]
    if lost:
        return f"servers {lost} were lost (their keys moved)"
    return ""


@dataclass
class Call:
    """A call the loop moves: its handle, the buffers that must outlive it, and what Python does once it is in."""

    handle: Handle
    tensor: str
    servers: list[int]
    keep: tuple  # the arrays the loop reads and writes, alive until the call completes
    average: int = 1
    pull: np.ndarray | None = None  # a plain call's output, divided by `average` once in
    works: list[Work] = field(default_factory=list)  # a call with a Python step per partition (Work.deliver)
    pushed: int = 0  # bytes, for the metrics
    pulled: int = 0


class NativePath:
    """A worker's links lent to gradwire-native's loop for their life. Thread-safe: `submit` from any thread."""

    def __init__(
        self,
        state: WorkerState,
        module: ModuleType,
        links: list[ServerLink],
        on_lost: Callable[[ServerLink, BaseException], None] | None = None,
    ) -> None:
        self.state = state
        self.links = links
        self._on_lost = on_lost  # failover on: told of a server's lost link (worker/failover.py)
        self._lost: set[int] = set()  # the links lost and not replaced (their sockets closed)
        self._lock = threading.Lock()
        self._calls: dict[int, Call] = {}
        self._numbers = itertools.count(1)
        self._plans: dict[tuple, tuple[Tensor, tuple]] = {}  # (tensor, cut) -> its plan and bytes (see `_plan`)
        self._stopping: BaseException | None = None
        self._stopped = threading.Event()  # the links are back (`stop`)
        self._escapes = 0  # the liveness rule's escapes said so far
        fds = [link.hand_over(LEND_SECONDS, borrower=self) for link in links]
        first, credit = links[0], links[0].credit
        arenas = [(a.memory, a.push, a.pull, a.slot_bytes) if (a := link.arena) else None for link in links]
        self.loop = module.WorkerLoop(
            fds,
            rank=state.rank,
            epoch=state.epoch,
            window=state.config.window,  # each link's within its shared slots (ServerLink._fitting), natively too
            cap=first.unanswered_cap,
            credit=credit.limit,
            max_payload=first.conn.max_payload,
            shares=[credit.share(link.server) for link in links],  # pacing, as connecting.py set it
            lead=credit.lead,
            pace_give_up=PACE_GIVE_UP_SECONDS,
            buckets=list(BUCKETS),  # the stage histogram, as the Python path records it (admin/metrics.py)
            arenas=arenas,  # same-host links' shared slots (transport/shm.py)
            failover=on_lost is not None,
        )
        self.loop.trace(state.timeline is not None)
        self._drainer = threading.Thread(target=self._drain, name=f"gw-native-{state.rank}", daemon=True)
        self._drainer.start()
        _running.add(self)

    @classmethod
    def start(
        cls,
        state: WorkerState,
        links: list[ServerLink | LostLink],
        on_lost: Callable[[ServerLink, BaseException], None] | None = None,
    ) -> NativePath | None:
        """The native path over `links` where it applies (module docstring), else None; says which once."""
        why = why_not(state, links)
        if why:  # said where the native path was asked for by name; else only at debug level
            level = logging.INFO if state.config.datapath == "native" else logging.DEBUG
            log.log(level, "worker %d: the Python data path for the worker's calls (%s)", state.rank, why)
            return None
        module = native.for_datapath(state.config.datapath)
        assert module is not None
        path = cls(state, module, [link for link in links if isinstance(link, ServerLink)], on_lost)
        log.info("worker %d: the native data path (%s)", state.rank, native.load().reason)
        return path

    # -- calls ----------------------------------------------------------------------------------------------------

    def submit(self, tensor: Tensor, rnd: int, transfer: Transfer, handle: Handle, servers: list[int]) -> None:
        """Move `transfer`'s partitions of `tensor`'s round `rnd`; `handle` completes (its declaration's part) or fails
        once every answer is in."""
        number = next(self._numbers)
        code, name = tensor.dtype.code, tensor.name
        try:
            if type(transfer) is Transfer and transfer.extra is None:
                plan, pushed, pulled, keep = self._plan(tensor, transfer, servers)
                send, pull = transfer.send.view(np.uint8), transfer.pull.view(np.uint8)
                call = Call(handle, name, servers, (send, pull), transfer.average, transfer.pull, pushed=pushed)
                call.pulled = pulled
                if self._open(number, call):
                    self.loop.submit(number, name, rnd, transfer.priority, code, send, pull, plan, keep)
                return
            works = list(transfer.works(tensor, rnd, handle))
            parts = [
                (work.key, server, work.index, np.frombuffer(work.send, np.uint8), _extra(work), _bytes(work.out))
                for server, work in zip(servers, works, strict=True)
            ]
            call = Call(handle, name, servers, tuple(parts), works=works)
            call.pushed, call.pulled = sum(work.push_bytes for work in works), sum(work.nbytes for work in works)
            keep = [_keep(w.partial, w.replayable, w.held) for w in works] if self._on_lost is not None else []
            if self._open(number, call):
                self.loop.submit_parts(number, name, rnd, transfer.priority, code, parts, keep)
        except Exception as e:  # a bug (a plan past its buffers): the call fails with it, nothing waits
            with self._lock:
                self._calls.pop(number, None)
            log.exception("worker %d: submitting %r to the native data path failed", self.state.rank, name)
            handle.fail(GradwireError(f"worker {self.state.rank}: submitting {name!r} failed: {e!r}"))

    def _open(self, number: int, call: Call) -> bool:
        """Count `call` in flight; False (its handle failed) once the path has stopped."""
        with self._lock:
            stopping = self._stopping
            if stopping is None:
                self._calls[number] = call
        if stopping is not None:
            call.handle.fail(stopping if isinstance(stopping, GradwireError) else GradwireError(str(stopping)))
        return stopping is None

    def _plan(self, tensor: Tensor, transfer: Transfer, servers: list[int]) -> tuple[list[tuple], int, int, list[int]]:
        """A plain call's parts, (key, server, send offset, send bytes, out offset, out bytes, partition index) in
        bytes, cut as `Transfer.works` cuts them (`Transfer.spans`: a gather's segment, a reduce-scatter's slice), the
        bytes pushed and pulled in all, and (failover on) what each part keeps of its answered round for a failover
        (`Transfer.keeps`, as a `Work` of `Transfer.works` has it); cached per tensor and cut: a step's calls cost no
        Python per partition."""
        cut = (
            *(tensor.name, transfer.send_at, len(transfer.send), transfer.pull_at, len(transfer.pull)),
            *(transfer.partial, tensor.held, tuple(servers), tuple(tensor.replicated or ())),
        )
        cached = self._plans.get(cut)
        if cached is not None and cached[0] is tensor:
            return cached[1]
        size, plan, keep = tensor.dtype.itemsize, [], []
        replicated = tensor.replicated or [False] * len(tensor.keys)
        for part, key, server, kept in zip(tensor.parts, tensor.keys, servers, replicated, strict=True):
            give_from, give_to, take_from, take_to = transfer.spans(part.start, part.count)
            spans = (give_from * size, (give_to - give_from) * size, take_from * size, (take_to - take_from) * size)
            plan.append((key, server, *spans, part.index))
            keep.append(_keep(*transfer.keeps(take_to - take_from < part.count, kept, tensor.held)))
        if self._on_lost is None:
            keep.clear()
        made = (plan, sum(part[3] for part in plan), sum(part[5] for part in plan), keep)
        self._plans[cut] = (tensor, made)
        return made

    def _drain(self) -> None:
        """(The drainer thread.) Complete each call the loop finished, until the loop stops."""
        while True:
            done = self.loop.completions(DRAIN_SECONDS)
            for number, error in done:
                if number == LINK_LOST:
                    self._link_lost(error)
                else:
                    self._complete(number, error)
            with self._lock:
                if self._stopping is not None and not self._calls and not done:
                    return

    def _complete(self, number: int, error: str) -> None:
        """Call `number` is done (`error`: what failed it): its Python step, metrics and handle. The call is referenced
        from nowhere once this returns: its output is the caller's alone."""
        with self._lock:
            call = self._calls.pop(number, None)
        if call is not None:
            self._finish(call, error)

    def _finish(self, call: Call, error: str) -> None:
        if error:
            call.handle.fail(self._error(call, error))
            return
        try:
            if call.pull is not None and call.average > 1:
                # integers: the quotient truncated toward zero, as Work.deliver divides
                np.divide(call.pull, call.average, out=call.pull, casting="unsafe")
            for work in call.works:
                work.deliver(None)
        except Exception as e:  # a bug must fail the call with its cause, not leave it waiting
            log.exception("worker %d: completing %r failed", self.state.rank, call.tensor)
            call.handle.fail(GradwireError(f"worker {self.state.rank}: completing {call.tensor!r} failed: {e!r}"))
            return
        metrics = self.state.metrics
        metrics.pushed(call.pushed)
        metrics.pulled(call.pulled)
        counts, seconds = self.loop.take_stages()
        if counts:
            metrics.stages(counts, seconds)
        self._traced()
        self._say_escapes()
        call.handle.part_done()

    def trace(self, on: bool) -> None:
        """Each answered partition's stages into the worker's timeline from now on, or no longer (`_traced`)."""
        self.loop.trace(on)

    def _traced(self) -> None:
        """The partitions the loop answered since last time, each one's stages into the timeline (as the Python
        path's answers.py puts them: one track per server), ahead of the call's completion. Nothing to take while
        no timeline is written (the loop keeps none, and drops what it kept when tracing stops)."""
        timeline = self.state.timeline
        if timeline is None:
            return
        rows, dropped = self.loop.take_traced()
        for tensor, key, rnd, nbytes, server, queued, sent, pushed, result, done, in_flight in rows:
            times = stages(queued, sent, pushed, result, done)
            timeline.partition(tensor, key, rnd, nbytes, times, server, done, in_flight)
        if dropped:
            log.warning(
                "worker %d: %d partitions' events did not fit in the native loop's trace", self.state.rank, dropped
            )

    def _say_escapes(self) -> None:
        """Warn, as worker/pushes.py does, where the liveness rule let a partition past a full cap since last time."""
        escapes = self.loop.cap_escapes
        if escapes > self._escapes:
            self._escapes = escapes
            log.warning(
                "worker %d: the cap on unanswered partitions held every queued partition for %.1f s with no answer; "
                "sent one anyway (%d times so far: workers pushing keys in different orders and waiting in between)",
                self.state.rank,
                LIVENESS_SECONDS,
                escapes,
            )

    def _error(self, call: Call, error: str) -> GradwireError | BaseException:
        """What failed a call, as the Python path says it (worker/answers.py, worker/link.py)."""
        rank = self.state.rank
        if self._stopping is not None:
            return self._stopping
        refused = refusal(call.tensor, error)
        if refused is not None:
            return refused
        ended = ENDED.fullmatch(error)
        if ended is not None:
            return abort_error(json.loads(ended.group(2)), server=int(ended.group(1)), rank=rank)
        link = LINK.fullmatch(error)
        if link is not None:
            server, protocol, why = int(link.group(1)), link.group(2), link.group(3)
            if protocol:
                return RemoteProtocolError(f"server {server}: {why}")
            peer = self.links[server].conn.peer if server < len(self.links) else "?"
            return JobAborted(f"worker {rank} lost server {server} ({peer}): {why}", server=server)
        return GradwireError(f"worker {rank}: {call.tensor!r}: {error}")

    # -- the links' life --------------------------------------------------------------------------------------------

    def set_limits(self, window: int, cap: int) -> None:
        """Every link's window and cap, and pacing's lead, from the next decision on (a RETUNE)."""
        self.loop.set_limits(window, cap, self.state.credit.lead if self.state.credit else 0)

    def link_use(self) -> tuple[float, int, float]:
        """The links' use for the scheduler's drift check: (seconds some push was unacknowledged, bytes acknowledged,
        seconds work waited on a full window), as worker/credit.py's `busy` and worker/flow.py's `full_seconds`."""
        return self.loop.link_use

    def credit_used(self) -> int:
        """Bytes pushed and not yet acknowledged, over all links (as of the loop's last pass)."""
        return self.loop.credit_used

    # -- failover (worker/failover.py) --------------------------------------------------------------------------------

    def _link_lost(self, error: str) -> None:
        """(The drainer.) A server closed its link, failover on: the loop keeps its parts; its socket is closed here
        and the failover told (which tells the scheduler)."""
        link_lost = LINK.fullmatch(error)
        server = int(link_lost.group(1)) if link_lost else -1
        if not 0 <= server < len(self.links) or self._on_lost is None:
            log.error("worker %d: the native data path lost a link it cannot name: %s", self.state.rank, error)
            return
        reason = ConnectionClosed(link_lost.group(3))
        self._retire(server, reason)
        self._on_lost(self.links[server], reason)

    def _retire(self, server: int, reason: BaseException) -> None:
        """The loop has let go of lost link `server` (its socket's flags as they were): close it."""
        with self._lock:
            if server in self._lost:
                return
            self._lost.add(server)
        self.links[server].take_back(reason)

    def detach(self, server: int) -> dict[int, int]:
        """Server `server` is lost (the scheduler moved its keys): what its link holds unanswered, key -> round. The
        loop keeps those parts until `reroute`; a link it had not seen die is lost now."""
        orphans = dict(self.loop.orphans(server))
        self._retire(server, ConnectionClosed(f"server {server} was declared lost by the scheduler"))
        return orphans

    def replace(self, server: int, link: ServerLink) -> None:
        """A standby's new link (connected and started) in lost server `server`'s place, lent to the loop."""
        fd = link.hand_over(LEND_SECONDS, borrower=self)
        arena = (link.arena.memory, link.arena.push, link.arena.pull, link.arena.slot_bytes) if link.arena else None
        self.loop.replace(server, fd, arena, link.epoch)
        with self._lock:
            self.links[server] = link
            self._lost.discard(server)

    def reroute(self, server: int, owners: dict[int, int]) -> None:
        """Lost server `server`'s parts, and any submitted to it later, go to their key's server in `owners`."""
        self.loop.reroute(server, owners)

    def seeds(self, keys: list[int]) -> dict[int, tuple[int, bool]]:
        """Of `keys`, those whose last answered round the loop keeps: key -> (round, whether it is this worker's
        contribution rather than the sum)."""
        return {key: (rnd, contribution) for key, rnd, contribution in self.loop.seeds(keys)}

    def finish_held(self, server: int) -> None:
        """The failover of lost server `server` is over: the parts its link held (their sums in their outputs, for a
        seed) are done, and their calls may complete."""
        self.loop.finish_held(server)

    def seed_bytes(self) -> int:
        """The bytes the loop keeps of the keys' last answered rounds."""
        return self.loop.seed_bytes()

    def unanswered(self, keys: list[int]) -> dict[int, int]:
        """Of `keys`, those in flight: key -> the round waited for."""
        return dict(self.loop.unanswered(keys))

    def push_seed(self, key: int, rnd: int, server: int) -> bool:
        """Push `key`'s kept round `rnd` to `server` (SEED, or REPLAY for a contribution); False if none is kept."""
        return self.loop.push_seed(key, rnd, server)

    def outstanding(self, name: str) -> list[int]:
        """The servers with partitions of `name` not answered yet (for a timeout's message)."""
        return list(self.loop.where(name)[0])

    def held(self, name: str) -> list[int]:
        """The servers whose sums of `name` are held until every worker has them (for a timeout's message)."""
        return list(self.loop.where(name)[1])

    def stop(self, reason: BaseException) -> None:
        """The loop ends (the worker shuts down, aborts, or re-forms): every call in flight fails with `reason`, and
        the links go back to the Python loop (to say BYE), or close where a call was cut off mid-frame. Idempotent."""
        draining = threading.current_thread() is self._drainer  # (a handle's callback may close the worker)
        with self._lock:
            first, cut_off = self._stopping is None, bool(self._calls)
            if first:
                self._stopping = reason
        if not first:  # another thread is stopping it: its links are back once that returns
            if not draining:
                self._stopped.wait(SHUTDOWN_JOIN_SECONDS)
            return
        try:
            self.loop.stop(str(reason))
            if not draining:
                self._drainer.join()
            for server, link in enumerate(self.links):
                if server not in self._lost:
                    link.take_back(reason if cut_off else None)
        finally:
            self._stopped.set()
            _running.discard(self)


_running: weakref.WeakSet[NativePath] = weakref.WeakSet()  # the paths not stopped yet


@atexit.register
def _stop_at_exit() -> None:
    """A process that exits with a native path running (no `shutdown`) stops it first: its drainer must not be waiting
    in the loop when the interpreter ends its threads (a thread ended inside native code aborts the process)."""
    for path in list(_running):
        path.stop(GradwireError("the process exits"))


def _keep(partial: bool, replayable: bool, held: bool) -> int:
    """What a part keeps of its answered round, from what `Transfer.keeps` says of it (as `Seed.of` and
    worker/holding.py treat a Python link's `Work`)."""
    if held:
        return KEEP_HELD
    return KEEP_CONTRIBUTION if replayable else KEEP_NOTHING if partial else KEEP_SUM


def _extra(work: Work) -> np.ndarray | None:
    return np.frombuffer(work.extra, np.uint8) if work.extra is not None else None


def _bytes(array: np.ndarray) -> np.ndarray:
    """`array`'s bytes, as a flat uint8 view."""
    return array.reshape(-1).view(np.uint8)
