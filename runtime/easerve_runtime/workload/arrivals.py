"""Arrival processes: Poisson, or Gamma renewal with a chosen coefficient of variation.

A Gamma inter-arrival distribution with shape k = 1/CV² and mean 1/λ has exactly the requested
CV: CV 1 is Poisson, CV 0.5 is more regular, CV 2 is burstier. The dispatch-policy comparison
and the arrival-sensitivity study (paper §4.5) sweep this knob, so it is exact, seeded and
independent of numpy.
"""

from __future__ import annotations

import random

ARRIVALS = ("poisson", "gamma")


def interarrival_gaps(
    rate: float, n: int, rng: random.Random, arrival: str = "poisson", cv: float = 1.0
) -> list[float]:
    """``n`` inter-arrival gaps (seconds) at mean rate ``rate`` req/s."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 req/s, got {rate}")
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(n)]
    if arrival == "gamma":
        if not cv > 0:
            raise ValueError(f"cv: must be > 0 for gamma arrivals, got {cv}")
        shape = 1.0 / (cv * cv)
        scale = 1.0 / (rate * shape)
        return [rng.gammavariate(shape, scale) for _ in range(n)]
    raise ValueError(f"arrival: must be one of {ARRIVALS}, got {arrival!r}")


def arrival_times(
    rate: float, n: int, rng: random.Random, arrival: str = "poisson", cv: float = 1.0
) -> list[float]:
    """Absolute arrival times; the first request arrives at t = 0 so runs start busy."""
    gaps = interarrival_gaps(rate, n, rng, arrival, cv)
    times: list[float] = []
    t = 0.0
    for i, g in enumerate(gaps):
        if i > 0:
            t += g
        times.append(t)
    return times
