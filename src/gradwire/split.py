"""How to split a step's bytes between colocated and dedicated servers: the model, generalised to any rates.

n worker hosts each run a colocated server; k dedicated servers run on hosts of their own. A fraction y_i of every
tensor's bytes is summed by the colocated server on worker host i, a fraction x_j by dedicated server j
(sum y + sum x = 1). Per step, with S bytes per worker:

- worker host i sends its pushes to every server but its own, S (1 - y_i), and its colocated server sends the sums
  of its share to the n - 1 other workers, (n - 1) y_i S: up_i = S (1 + (n - 2) y_i), and down_i the same;
- dedicated server j receives n x_j S and sends n x_j S.

Each link has a rate, so the step takes T = max over links of bytes / rate, and the best split minimises T. With
m_i = min(up, down rate) of worker host i and M_j that of server j, T is feasible iff every worker can at least push
its own bytes (T m_i >= S) and the shares the links allow add up to 1:

    sum_i min(1, (T m_i / S - 1) / (n - 2)) + sum_j min(1, T M_j / (n S)) >= 1        (n > 2)

T is found by bisection and the shares are taken in proportion to what each link allows at that T. For equal rates
this is BytePS's optimum (OSDI'20): a fraction 2k(n-1)/(n^2 + kn - 2k) to the dedicated servers, in time
2n(n-1)S/((n^2 + kn - 2k)B); k = 0 gives all-reduce's 2(n-1)/n S/B and k = n gives S/B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """The chosen shares and the model's time for one step of `nbytes` per worker."""

    colocated: tuple[float, ...]  # y_i, one per worker host
    dedicated: tuple[float, ...]  # x_j, one per dedicated server
    seconds: float

    @property
    def dedicated_fraction(self) -> float:
        return sum(self.dedicated)


def closed_form(n: int, k: int) -> tuple[float, float]:
    """Equal rates B: (fraction of bytes to the dedicated servers, time in units of S/B)."""
    if not 0 <= k <= n:
        raise ValueError(f"the closed form needs 0 <= k <= n, got n={n} k={k}")
    denominator = n * n + k * n - 2 * k
    return 2 * k * (n - 1) / denominator, 2 * n * (n - 1) / denominator


def optimal(
    nbytes: float,
    worker_rates: Sequence[float],
    server_rates: Sequence[float],
    colocated: Sequence[bool] | None = None,
) -> Split:
    """The split minimising the model's step time; rates in bytes per second (min of up and down per host).

    `colocated[i]` says whether worker host i runs a colocated server (default: every host does); a host without one
    gets no share. With no colocated server at all this is the pure service, bytes in proportion to server rates.
    """
    n, s = len(worker_rates), float(nbytes)
    has = list(colocated) if colocated is not None else [True] * n
    if n < 1 or min(worker_rates) <= 0 or (server_rates and min(server_rates) <= 0) or len(has) != n:
        raise ValueError("need at least one worker, positive rates and one colocated flag per worker host")
    if not any(has) and not server_rates:
        raise ValueError("no server to place anything on")
    if n <= 2 and any(has):  # a worker's traffic is S whatever its colocated share (n = 1: nothing moves at all)
        seconds = 0.0 if n == 1 else s / min(worker_rates)
        ys = tuple(1.0 / sum(has) if h else 0.0 for h in has)
        return Split(ys, tuple(0.0 for _ in server_rates), seconds)

    def shares(t: float) -> tuple[list[float], list[float]]:
        ys = [
            min(1.0, max(0.0, (t * m / s - 1) / (n - 2))) if h and n > 2 else 0.0
            for m, h in zip(worker_rates, has, strict=True)
        ]
        xs = [min(1.0, t * m / (n * s)) for m in server_rates]
        return ys, xs

    lo = s / min(worker_rates)  # every worker pushes at least what is not its own share
    hi = lo * n  # all on the slowest worker's colocated server is always feasible by then
    while sum(map(sum, shares(hi))) < 1:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        ys, xs = shares(mid)
        if mid * min(worker_rates) >= s and sum(ys) + sum(xs) >= 1:
            hi = mid
        else:
            lo = mid
    ys, xs = shares(hi)
    total = sum(ys) + sum(xs)
    return Split(tuple(y / total for y in ys), tuple(x / total for x in xs), hi)


def server_weights(
    host_rates: Sequence[float],
    servers: Sequence[tuple[int | None, float]],
) -> tuple[list[float], Split]:
    """Placement weights for every server, from the optimal split (what the scheduler gives `Placement`).

    `host_rates[i]` is worker host i's rate; `servers[r]` is (the worker host index it is colocated on, or None for
    a dedicated server; its own rate, used for dedicated ones). Several colocated servers on one host share that
    host's share equally. Returns one weight per server (0: nothing goes there) and the split.
    """
    colocated_on = [0] * len(host_rates)
    for host, _ in servers:
        if host is not None:
            colocated_on[host] += 1
    dedicated = [rate for host, rate in servers if host is None]
    best = optimal(1.0, host_rates, dedicated, [c > 0 for c in colocated_on])
    weights, j = [], 0
    for host, _ in servers:
        if host is None:
            weights.append(best.dedicated[j])
            j += 1
        else:
            weights.append(best.colocated[host] / colocated_on[host])
    return weights, best


def ring_seconds(nbytes: float, worker_rates: Sequence[float]) -> float:
    """Ring all-reduce: every worker sends and receives 2(n-1)/n S, so the slowest link sets the pace."""
    n = len(worker_rates)
    return 2 * (n - 1) / n * nbytes / min(worker_rates) if n > 1 else 0.0


def service_seconds(nbytes: float, worker_rates: Sequence[float], server_rates: Sequence[float]) -> float:
    """Dedicated servers only, bytes in proportion to their rates: max(S/B_worker, n S / sum of server rates)."""
    n = len(worker_rates)
    return max(nbytes / min(worker_rates), n * nbytes / sum(server_rates)) if server_rates else float("inf")
