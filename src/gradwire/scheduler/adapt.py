"""Following the links while the job runs (GRADWIRE_ADAPT, on by default): the settings derived at the rendezvous
(gradwire/tuning.py) are derived again when the rate the workers' links achieve drifts away from the one they were
derived for (tuning.Drift says when, and how that is damped).

Window and cap change on every link at once (RETUNE). A new partition size also re-cuts the tensors already declared,
which every worker must do at the same round of each tensor, or a round would wait for partitions that another
worker cuts differently. That takes two messages, neither of which waits for the data path:
1. RECUT (re-cut number g) to every worker. Each answers from its control thread with its round of every tensor
   (RECUT_ROUNDS), and from then on holds any call two rounds past the one it reported until step 2 arrives.
2. Once every worker has answered: RETUNE with the new settings and, per tensor, the first round cut anew: the
   latest round any worker reported, plus two. No worker can have passed it (step 1's hold), so each starts that
   round on the tensor's new partitions (declared at once, under `name~g`: new keys; the old ones stay declared)
   and they all agree. A worker whose partition size is set explicitly (GRADWIRE_PARTITION_BYTES) vetoes the re-cut,
   and so does a failover or an elastic reset in between (they re-derive the settings themselves).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from gradwire import tuning
from gradwire.protocol import messages
from gradwire.scheduler.placing import host_of, placement_weights

if TYPE_CHECKING:
    from gradwire.scheduler.node import Node
    from gradwire.scheduler.roster import Roster

log = logging.getLogger("gradwire.scheduler")
CPU = ("host_cpu_busy_seconds", "host_cpu_seconds")  # in every node's heartbeat (admin/metrics.host_cpu)
RECUT_AHEAD = messages.RECUT_AHEAD  # rounds past the latest a worker reported: the first cut anew (step 2)


class Adaptation:
    """The scheduler's drift check, re-derivations and re-cuts; every method is called with the roster's lock held."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.drift = tuning.Drift(roster.config.heartbeat_interval)
        self.recuts = 0  # re-cuts begun: each is numbered
        self.pending: dict | None = None  # a re-cut in step 1: its number, tuning, why, answers {rank: (rounds, fixed)}
        self.seen: dict[tuple[str, int, str], tuple[float, ...]] = {}  # a node's counters at the last interval
        self.history: list[dict] = []  # each re-derivation: when, why, and the settings

    def tick(self, now: float) -> None:
        """One interval: take every worker's counters, and act on the drift check's verdict."""
        samples = self._samples()
        if self.pending is not None:
            if now - self.pending["started"] > self.roster.config.timeout:
                self.cancel("not every worker answered in time")
            else:
                self._maybe_finish()
            return
        if self.roster.tuning is None or self.roster.joins or self.roster.ending:
            return
        rate = self.drift.observe(now, samples, self.roster.tuning, self._host_busy())
        if rate is not None:
            self._rederive(rate, now)

    def _samples(self) -> list[tuning.Sample]:
        """One sample per worker host: its workers share its link, so the link's rate is judged per host
        (tuning.Sample.of_host), in the per-worker share the settings were derived for."""
        now = self.roster.tuning
        shared = now is not None and max(now.workers_per_host, default=1) > 1  # placing.link_sharers
        hosts: dict[str, list[tuning.Sample]] = {}
        for worker in self.roster.live_workers():
            delta = self._delta(worker, messages.LINK_USE)
            if delta is not None:
                busy, moved, full = delta
                key = host_of(worker) if shared else f"worker{worker.rank}"
                hosts.setdefault(key, []).append(tuning.Sample(int(moved), busy, full))
        return [tuning.Sample.of_host(samples) for samples in hosts.values()]

    def _host_busy(self) -> float | None:
        """The share of the interval the job's hosts' CPUs were busy: the busiest server's host, or the median
        worker's, whichever is more (a server short of CPU holds every worker's pushes; one busy worker host, such as
        one loading data, does not). None where no node reports it."""
        shares: dict[str, list[float]] = {"worker": [], "server": []}
        for node in [*self.roster.live_workers(), *self.roster.live_servers()]:
            delta = self._delta(node, CPU)
            if delta is not None and delta[1] > 0:
                shares[node.role].append(delta[0] / delta[1])
        workers = sorted(shares["worker"])
        candidates = [*shares["server"], *(workers[len(workers) // 2 : len(workers) // 2 + 1])]
        return max(candidates) if candidates else None

    def _delta(self, node: Node, counters: tuple[str, ...]) -> tuple[float, ...] | None:
        """`counters` of `node`'s heartbeat since the last interval; None the first time, or where a counter is
        missing or went back (the node started its counters afresh: an elastic reset)."""
        try:
            now = tuple(float(node.stats[c]) for c in counters)
        except (KeyError, TypeError, ValueError):
            return None
        key = (node.role, node.rank, counters[0])
        before, self.seen[key] = self.seen.get(key), now
        if before is None or any(a < b for a, b in zip(now, before, strict=True)):
            return None
        return tuple(a - b for a, b in zip(now, before, strict=True))

    def _rederive(self, rate: float, now: float) -> None:
        assert self.roster.tuning is not None
        model = self.roster.tuning.rate_bytes_per_s
        self.roster.rate_scale *= rate / model
        why = (
            f"the links moved {rate * 8 / 1e6:.0f} Mbit/s per worker, the settings were for {model * 8 / 1e6:.0f} "
            f"(measured over {tuning.DRIFT_SAMPLES} intervals)"
        )
        new = for_job_now(self.roster)
        if new is None:
            return
        record = {"at": time.time(), "why": why, "recut_tensors": 0} | new.settings()
        self.history.append(record)
        log.info("data path re-derived (%s): %s", why, new.reason)
        if new.partition_bytes == self.roster.tuning.partition_bytes:
            self._apply(new.again(why), {}, 0)
            return
        self.recuts += 1
        self.pending = {"number": self.recuts, "tuning": new, "why": why, "answers": {}, "started": now}
        self.roster.tell(self.roster.live_workers(), messages.Recut(self.recuts))

    def answered(self, node: Node, answer: messages.RecutRounds) -> None:
        """A worker's RECUT_ROUNDS."""
        if self.pending is None or answer.number != self.pending["number"]:
            return  # cancelled meanwhile: the cancel's RETUNE released it
        rounds = {str(k): int(v) for k, v in answer.rounds.items()}
        self.pending["answers"][node.rank] = (rounds, answer.fixed, answer.largest_partition)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        assert self.pending is not None
        answers = self.pending["answers"]
        live = [w.rank for w in self.roster.live_workers()]
        if not all(rank in answers for rank in live):
            return
        pending, self.pending = self.pending, None
        settings: tuning.Tuning = pending["tuning"].again(pending["why"])
        largest = min((answers[rank][2] for rank in live), default=settings.partition_bytes)
        if settings.partition_bytes > largest:  # a worker's shared-memory slots, made for the partitions of then
            kept = f" (partitions kept at {largest >> 10} KiB: the largest the workers' links carry)"
            settings = replace(settings.explained(kept), partition_bytes=largest)
        fixed = [rank for rank in live if answers[rank][1]]
        switch: dict[str, int] = {}
        if fixed:
            log.warning("tensors not re-cut: worker %s set GRADWIRE_PARTITION_BYTES", ", ".join(map(str, fixed)))
        elif self.roster.tuning is None or settings.partition_bytes != self.roster.tuning.partition_bytes:
            names = set.intersection(*(set(answers[rank][0]) for rank in live)) if live else set()
            switch = {name: max(answers[rank][0][name] for rank in live) + RECUT_AHEAD for name in sorted(names)}
        self.history[-1] |= {"recut_tensors": len(switch), "partition_bytes": settings.partition_bytes}
        self._apply(settings, switch, pending["number"])

    def _apply(self, settings: tuning.Tuning, switch: dict[str, int], number: int) -> None:
        self.roster.tuning = settings
        self.roster.tell(self.roster.live_workers(), messages.Retune(settings.as_dict(), switch, number))

    def cancel(self, why: str) -> None:
        """Give up the re-cut in step 1 (a failover, an elastic reset, a worker that does not answer): the workers'
        holds are released, nothing is re-cut."""
        if self.pending is None:
            return
        log.warning("re-cut %d given up: %s", self.pending["number"], why)
        number, self.pending = self.pending["number"], None
        now = self.roster.tuning
        self.roster.tell(self.roster.live_workers(), messages.Retune(now and now.as_dict(), {}, number))

    def retune_locked(self, why: str) -> tuning.Tuning | None:
        """Re-derive the settings for the job as it is now (after a failover or an elastic reset: other workers,
        fewer servers), from the rates measured at the start. Kept as they are where a node's rate is unknown (a
        standby or a joining worker on a host never measured). Returns the settings in force."""
        self.cancel(why)  # a re-cut in progress: the job it was for has changed
        new = for_job_now(self.roster)
        if new is not None and self.roster.tuning is not None:
            if new.settings() != self.roster.tuning.settings():
                log.info("data path re-derived (%s): %s", why, new.reason)
            self.roster.tuning = new.again(why)
        return self.roster.tuning

    def status(self) -> dict:
        """For /status and `gradwire top`."""
        return {
            "last_interval": {k: round(v, 3) if isinstance(v, float) else v for k, v in self.drift.last.items()},
            "rederived": self.history[-5:],
            "next_possible_in_seconds": round(max(0.0, self.drift.not_before - self.roster.clock()), 1),
        }


def derive(roster: Roster, info: dict) -> tuning.Tuning | None:
    """The data path's settings (gradwire/tuning.py) for the links described by `info` (placement_weights'): the
    worker hosts' and dedicated servers' rates, and the median round trip. None when rates are unknown."""
    rates = info.get("rates_bytes_per_s") or {}
    if not rates:
        return None
    dedicated = [r for r, c in zip(rates.get("servers") or [], info.get("colocated") or [], strict=False) if not c]
    # a worker-server round trip is about the mean of the two nodes' round trips to the scheduler (a star)
    rtts = sorted(n.rtt for n in roster.workers + roster.servers if n.rtt > 0)
    rtt = rtts[len(rtts) // 2] if rtts else 0.0
    scale = roster.rate_scale  # where the drift check found the links faster or slower than measured at the start
    # the workers of one host share its link: each pushes and pulls its own copy, so each has its share of it
    sharing = info["workers_per_host"]  # placing.link_sharers
    workers = [r * scale / m for r, m in zip(rates["worker_hosts"], sharing, strict=True) for _ in range(m)]
    servers = len(rates.get("servers") or [])  # a worker's partitions spread over all of them, colocated too
    derived = tuning.derive(workers, rtt, server_rates=[r * scale for r in dedicated], servers=servers)
    derived = replace(derived, workers_per_host=tuple(sharing))  # the drift check judges the links in the same shares
    if max(sharing, default=1) > 1:
        most = max(sharing)
        derived = derived.explained(
            f" (a host's link shared by {'up to ' if min(sharing) < most else ''}{most} workers)"
        )
    return derived


def for_job_now(roster: Roster) -> tuning.Tuning | None:
    """The settings for the job as it is now: its live servers, the rates measured at the start (times the drift
    check's scale). None where a rate is unknown."""
    config = roster.config
    _, info = placement_weights(config.placement, roster.workers, roster.live_servers(), config.server_efficiency)
    return derive(roster, info)
