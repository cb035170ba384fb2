"""A minimal virtual-time event loop: a heap of (time, sequence, callback, args).

The sequence number makes ties deterministic (first scheduled, first run), which is what makes
a seeded twin run reproducible bit for bit. Callbacks read ``loop.now``; nothing sleeps.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    __slots__ = ("now", "_q", "_seq", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before ``now``)."""
        if t < self.now:
            t = self.now
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn, args))

    def run(self, until: float = float("inf")) -> None:
        q = self._q
        pop = heapq.heappop
        while q:
            if q[0][0] > until:
                break
            t, _, fn, args = pop(q)
            self.now = t
            self.events += 1
            fn(*args)
