"""Admission control at the frontend: a bounded queue sized from measured capacity. Pure.

Why: an open-loop client faster than the deployment makes every queue grow without bound; an
accepted request then waits so long that some internal hop gives up on it and it fails late,
after work was spent on it. Refusing cheaply at the door (429 with ``Retry-After``) keeps the
queue short, so every request that is admitted completes in bounded time.

What is bounded is the number of admitted requests still waiting for their first token (in
encode, in the prefill queues): decoding requests do not delay a newcomer's first token much
(continuous batching), so counting them would refuse work the deployment can take.

By Little's law a queue of ``L`` requests drained at ``C`` req/s makes a newcomer wait about
``L / C``; so the bound starts at ``ceil(C x queue_seconds)`` (``spec.limits.queueSeconds``), ``C``
being the saturation rate of the deployment's profile (``profiles.capacity``). A profile is not
the machine, though (a busy host, a slower GPU, a different workload), so the bound then follows
what is measured, AIMD on the first-token delay: a first token later than the lowest TTFT seen
plus ``queue_seconds`` shrinks the bound by 10 % (at most once per ``queue_seconds``), every one on
time grows it by ``1 / bound`` (so it recovers after a burst), up to ``GROWTH`` x the profile's
bound. Measured (docs/reliability.md): with room above the profile's bound (2x) the delay signal
arrives one TTFT late and overload P99 TTFT grew to 4.8x its 80 %-load value; capped at the
profile's bound it stayed at 1.4x, at the price of ~4 % refusals of 80 %-load bursts with a 2 s
budget (hence the 3 s default of ``spec.limits.queueSeconds``).
``spec.limits.maxQueuedRequests`` fixes the bound instead. ``Retry-After`` is the time the queue
needs to drain one slot at the observed first-token rate (an EWMA, falling back to ``C``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from easerve_runtime.api import LimitsSpec

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
NOT_READY_RETRY_AFTER_S = 5
RATE_HALF_LIFE_S = 5.0


@dataclass(frozen=True)
class Admission:
    """The decision for one request: admitted, or refused with an HTTP status and Retry-After."""

    admitted: bool
    status: int = 200
    retry_after_s: int = 0
    reason: str = ""


def queue_bound(capacity_rps: float, queue_seconds: float, override: int | None = None) -> int:
    """Most admitted requests waiting for a first token: the override, or ceil(C x seconds) (>= 1)."""
    if override is not None:
        return max(1, int(override))
    if not math.isfinite(capacity_rps) or capacity_rps <= 0:
        return 1
    return max(1, math.ceil(capacity_rps * queue_seconds))


DECREASE = 0.9
GROWTH = 1.0


class AdmissionQueue:
    """Counts admitted requests before their first token and refuses beyond ``bound``.

    ``adaptive`` (the default) lets the bound follow the measured first-token delay below the
    initial ``bound``; ``queue_seconds`` is the delay budget above the lowest TTFT seen.
    """

    def __init__(self, bound: int, capacity_rps: float, queue_seconds: float = 2.0, adaptive: bool = True) -> None:
        if bound < 1:
            raise ValueError(f"bound: must be >= 1, got {bound}")
        self.max_bound = max(bound, math.ceil(GROWTH * bound)) if adaptive else bound
        self._bound = float(bound)
        self.adaptive = adaptive
        self.queue_seconds = queue_seconds
        self.floor_ttft: float | None = None
        self._last_decrease = -math.inf
        self.capacity_rps = capacity_rps if math.isfinite(capacity_rps) and capacity_rps > 0 else 1.0
        self.waiting = 0
        self.admitted = 0
        self.refused = 0
        self._rate = 0.0
        self._last: float | None = None
        self._seen = 0

    def admit(self, now: float, ready: bool = True) -> Admission:
        """Admit one request (counted as waiting) or refuse it: 503 while not ready, 429 when full."""
        if not ready:
            self.refused += 1
            return Admission(False, 503, NOT_READY_RETRY_AFTER_S, "not ready: no live encode worker")
        if self.waiting >= self.bound:
            self.refused += 1
            return Admission(
                False, 429, self.retry_after(now), f"admission queue full ({self.waiting} of {self.bound} waiting)"
            )
        self.waiting += 1
        self.admitted += 1
        return Admission(True)

    @property
    def bound(self) -> int:
        return max(1, int(self._bound))

    def first_token(self, now: float, ttft: float | None = None) -> None:
        """An admitted request got its first token ``ttft`` s after admission: it leaves the queue."""
        self.waiting = max(0, self.waiting - 1)
        if self.adaptive and ttft is not None:
            self._adapt(now, ttft)
        if self._last is not None:
            dt = max(now - self._last, 1e-6)
            w = 1.0 - 0.5 ** (dt / RATE_HALF_LIFE_S)
            self._rate = (1.0 - w) * self._rate + w * (1.0 / dt)
        self._last = now
        self._seen += 1

    def _adapt(self, now: float, ttft: float) -> None:
        floor = self.floor_ttft
        # the lowest TTFT seen, drifting up slowly so one lucky request does not pin it forever
        self.floor_ttft = ttft if floor is None else min(ttft, floor + 0.01 * (ttft - floor))
        target = self.floor_ttft + self.queue_seconds
        if ttft > target:
            if now - self._last_decrease >= self.queue_seconds:
                self._bound = max(1.0, self._bound * DECREASE)
                self._last_decrease = now
        else:
            self._bound = min(float(self.max_bound), self._bound + 1.0 / self._bound)

    def left_early(self) -> None:
        """An admitted request ended before its first token (invalid, error, disconnect)."""
        self.waiting = max(0, self.waiting - 1)

    @property
    def drain_rate(self) -> float:
        """First tokens per second: observed once 8 were seen, else the measured capacity."""
        return self._rate if self._seen >= 8 and self._rate > 0 else self.capacity_rps

    def retry_after(self, now: float) -> int:
        """Seconds until the queue has drained to one free slot at the drain rate, in [1, 60]."""
        excess = self.waiting - self.bound + 1
        secs = math.ceil(max(excess, 1) / max(self.drain_rate, 1e-3))
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, secs))


def admission_queue(limits: LimitsSpec, capacity_rps: float) -> AdmissionQueue:
    """A frontend's queue for ``spec.limits`` at ``capacity_rps``: the one construction the live
    frontend (``workers.frontend``) and the twin's front door (``sim.frontdoor``) both use."""
    bound = queue_bound(capacity_rps, limits.queue_seconds, limits.max_queued_requests)
    return AdmissionQueue(bound, capacity_rps, limits.queue_seconds, adaptive=limits.max_queued_requests is None)
