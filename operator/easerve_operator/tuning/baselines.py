"""The two search baselines of paper §4.3, over the same space as HAS (no Stage-1 pruning).

- ``RandomProposer`` samples uniformly over the whole discretised space, without replacement
  (a repeat would teach nothing, and the loop would answer it from memory anyway).
- ``CoordinateProposer`` does coordinate descent: from a seeded random start, it scans one
  dimension at a time (allocation, then B, then s) with the other two fixed, moves to the best
  point of that line, and stops once a full cycle moves nowhere.

Both are pure functions of (seed, history), so a killed baseline search resumes by replay,
exactly like HAS. They share the loop, budget, stop rules and selection rule with HAS.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from easerve_operator.tuning.loop import Proposal, replay
from easerve_operator.tuning.records import TrialRecord
from easerve_operator.tuning.space import Candidate, SearchSpace
from easerve_operator.tuning.stage2 import derive_seed


class RandomProposer:
    method = "random"

    def __init__(self, space: SearchSpace, seed: int) -> None:
        self.space = space
        self.seed = seed
        self._points = list(space.points())
        self._visited: set[tuple[Any, ...]] = set()
        self._n = 0

    def ask(self) -> Proposal | None:
        left = [p for p in self._points if p.key() not in self._visited]
        if not left:
            return None
        rng = random.Random(derive_seed(self.seed, self._n))
        return Proposal(rng.choice(left))

    def tell(self, record: TrialRecord) -> None:
        self._visited.add(record.candidate.key())
        self._n += 1

    def restore(self, records: Sequence[TrialRecord]) -> None:
        replay(self, records)


class CoordinateProposer:
    method = "coordinate"
    DIMS = ("alloc", "B", "s")

    def __init__(self, space: SearchSpace, seed: int) -> None:
        self.space = space
        self.seed = seed
        rng = random.Random(derive_seed(seed, 0))
        a = rng.choice(space.allocations)
        self.current = Candidate(a, rng.choice(space.batch_values()), rng.choice(space.s_values(a)))
        self._values: dict[tuple[Any, ...], float | None] = {}
        self._dim = 0
        self._moved_in_cycle = False
        self._dims_done = 0
        self._queue: list[Candidate] = [self.current]
        self._line: list[Candidate] = []
        self._done = False

    def _line_of(self, dim: str) -> list[Candidate]:
        c = self.current
        if dim == "alloc":
            line = []
            for a in self.space.allocations:  # keep s where the allocation allows it (space.nearest_s)
                line.append(Candidate(a, c.batch_bound, self.space.nearest_s(a, c.offload_ratio)))
            return line
        if dim == "B":
            return [Candidate(c.alloc, b, c.offload_ratio) for b in self.space.batch_values()]
        return [Candidate(c.alloc, c.batch_bound, s) for s in self.space.s_values(c.alloc)]

    def _advance(self) -> None:
        """Finish the current line (move to its best point) and open the next non-trivial one."""
        while not self._queue and not self._done:
            if self._line:
                scored = [(self._values.get(p.key()), p) for p in self._line]
                good = [(v, p) for v, p in scored if v is not None]
                if good:
                    best_v, best_p = max(good, key=lambda t: t[0])
                    cur_v = self._values.get(self.current.key())
                    if best_p.key() != self.current.key() and (cur_v is None or best_v > cur_v):
                        self.current = best_p
                        self._moved_in_cycle = True
                self._dim = (self._dim + 1) % len(self.DIMS)
                self._dims_done += 1
                if self._dims_done % len(self.DIMS) == 0:
                    if not self._moved_in_cycle:
                        self._done = True
                        return
                    self._moved_in_cycle = False
            self._line = self._line_of(self.DIMS[self._dim])
            self._queue = [p for p in self._line if p.key() not in self._values]

    def ask(self) -> Proposal | None:
        self._advance()
        if self._done or not self._queue:
            return None
        return Proposal(self._queue[0])

    def tell(self, record: TrialRecord) -> None:
        self._values[record.candidate.key()] = record.value if record.ok else None
        self._queue = [p for p in self._queue if p.key() != record.candidate.key()]

    def restore(self, records: Sequence[TrialRecord]) -> None:
        replay(self, records)
