"""What the last scheduler left under way when it died, read from the workers' reports (RESUME, worker/report.py), for
the scheduler that resumes the job to finish (scheduler/recovery.py, docs/faults.md "The scheduler"): a server
failover (some workers were not told of it, or not told it is over) and a re-cut (scheduler/adapt.py: its RETUNE
reached some workers or none).
"""

from __future__ import annotations

from gradwire.protocol import messages
from gradwire.protocol.messages import decode
from gradwire.scheduler.failover import held_of
from gradwire.tuning import Tuning


def failover(workers: list[messages.Resume]) -> tuple[messages.Replace, dict[int, dict], list[int]] | None:
    """The latest server failover, if it was left under way: some worker was not told of it (an older epoch), or not
    told it is over (its SEED). Its REPLACE, what each worker told holds of the moved keys now (worker/failover.py
    `latest`; a worker that joined since holds none), and the workers not told; None if there is none to finish."""
    entries = {r.rank: r.report["failover"] for r in workers if r.report.get("failover")}
    if not entries:
        return None
    latest = max(int(e["replace"]["epoch"]) for e in entries.values())
    told = {rank: e for rank, e in entries.items() if int(e["replace"]["epoch"]) == latest}
    untold = sorted(r.rank for r in workers if r.epoch < latest)
    if not untold and all(e["over"] for e in told.values()):
        return None
    body = decode(messages.Replace, next(iter(told.values()))["replace"] | {"op": messages.Replace.op})
    assert isinstance(body, messages.Replace)
    held = {r.rank: held_of(told[r.rank]["held"]) if r.rank in told else {} for r in workers if r.epoch >= latest}
    return body, held, untold


def recut(workers: list[messages.Resume], tuning: Tuning | None) -> tuple[int, messages.Retune | None, list[int]]:
    """The latest re-cut the workers heard of (the next one is numbered after it: its tensors' successors are named
    by it), and, if it was left under way, the RETUNE that ends it and the workers to send it to: the one some worker
    applied, to the others (they are held short of the round it switches at); a cancel (`tuning`, the settings in
    force, and nothing re-cut) to all when none did (their calls are held until one comes)."""
    none = {"number": 0, "held": False, "retune": None}
    entries = {r.rank: r.report.get("recut") or none for r in workers}
    latest = max((int(e["number"]) for e in entries.values()), default=0)

    def applied(entry: dict) -> bool:
        return bool(entry["retune"]) and int(entry["retune"]["recut"]) == latest

    told = [e["retune"] for e in entries.values() if applied(e)]
    if told:
        body = decode(messages.Retune, told[0] | {"op": messages.Retune.op})
        assert isinstance(body, messages.Retune)
        return latest, body, sorted(rank for rank, e in entries.items() if not applied(e))
    if any(e["held"] for e in entries.values()):
        return latest, messages.Retune(tuning and tuning.as_dict(), {}, latest), sorted(entries)
    return latest, None, []
