"""A decode loop's statistics file, rewritten every few seconds (benchmarks read it).

Why a file rather than metrics: ``benchmarks/gpu_serve.py`` takes differences of the loop's and the
engine's cumulative counters over one load point, and reads them after the point, from a process
it did not start. Both decode loops (the decode worker's and the aggregated worker's) write the
same document through this one class; statistics never stop serving: a failed write is logged
once and writing stops.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("easerve.stats")

STATS_ENV = "EASERVE_DECODE_STATS"
"""A directory: each decode loop writes ``decode-<pid>.json`` there."""
STATS_EVERY_S = 2.0


class StatsFile:
    """``decode-<pid>.json`` in ``$EASERVE_DECODE_STATS`` (nothing when unset), written atomically."""

    def __init__(self, what: str) -> None:
        d = os.environ.get(STATS_ENV)
        self.path = os.path.join(d, f"decode-{os.getpid()}.json") if d else None
        self.what = what
        self._at = 0.0

    def write(self, now: float, doc: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Write ``doc()`` if ``STATS_EVERY_S`` passed since the last write (or ``force``)."""
        if self.path is None or (not force and now - self._at < STATS_EVERY_S):
            return
        self._at = now
        try:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"t": time.time(), **doc()}, f)
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError) as exc:
            log.warning("%s stats not written: %s", self.what, exc)
            self.path = None
