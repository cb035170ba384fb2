"""Routing decisions after encode: remote vs local prefill (deficit), and which remote worker.

Partial offload (EAServe §3.3) sends a fraction s of prefills to the remote prefill pool and keeps
the rest on the local prefill worker that shares the encode GPU. Random routing with probability s
would give the right mean but bursty runs (long streaks to one side inflate queues there); the
deficit counter spreads decisions as evenly as any sequence can: keep d = 0, and per request
d += s; if d >= 1 route REMOTE and d -= 1, otherwise LOCAL. After n requests exactly ⌊n·s⌋ went
remote, REMOTE runs are at most ⌈1/(1-s)⌉ long and LOCAL runs at most ⌈1/s⌉.

Floating point: summing 0.1 ten times gives 0.9999999999999999, so a float accumulator would
drift and a run could be one too long. We accumulate in exact integers instead: a float s is a
dyadic rational p/q (``float.as_integer_ratio``), and d is kept as an integer numerator over q.
Hence s = 1 is always REMOTE, s = 0 always LOCAL, and the counts are exact for every n.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Hashable, Mapping, Sequence
from enum import StrEnum
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


class Route(StrEnum):
    REMOTE = "remote"
    LOCAL = "local"


class DeficitRouter:
    """Deterministic REMOTE/LOCAL split with ratio ``s`` (``spec.offload.ratio``)."""

    __slots__ = ("_num", "_den", "_d", "_ratio", "remote_count", "local_count")

    def __init__(self, s: float) -> None:
        self._d = 0
        self._num = 0
        self._den = 1
        self._ratio = 0.0
        self.remote_count = 0
        self.local_count = 0
        self.set_ratio(s)

    @property
    def ratio(self) -> float:
        return self._ratio

    def set_ratio(self, s: float) -> None:
        """Change s on the fly (HAS may retune); the accumulated deficit is carried over."""
        if isinstance(s, bool) or not isinstance(s, int | float) or not (0.0 <= float(s) <= 1.0):
            raise ValueError(f"offload ratio s must be a number in [0, 1], got {s!r}")
        num, den = float(s).as_integer_ratio()
        # carry d over, rounding down so the invariant 0 <= d < 1 keeps holding
        self._d = (self._d * den) // self._den
        self._num, self._den, self._ratio = num, den, float(s)

    @property
    def deficit(self) -> float:
        """d in [0, 1): the fraction of a remote request owed so far (exported as a gauge)."""
        return self._d / self._den

    def decide(self) -> Route:
        d = self._d + self._num
        if d >= self._den:
            self._d = d - self._den
            self.remote_count += 1
            return Route.REMOTE
        self._d = d
        self.local_count += 1
        return Route.LOCAL


def least_outstanding(candidates: Sequence[K], outstanding: Mapping[K, int], start: int = 0) -> K:
    """The candidate with the fewest outstanding requests (missing keys count as 0).

    Ties go to the first tied candidate at or after position ``start`` (cyclically), so a caller
    that advances ``start`` past its last pick rotates among equally loaded workers instead of
    piling onto the first one whenever requests finish quickly. ``LeastOutstanding`` does that.
    """
    n = len(candidates)
    if n == 0:
        raise ValueError("least_outstanding: no candidates")
    return candidates[_pick_index(candidates, outstanding, start % n)]


def _pick_index(candidates: Sequence[K], outstanding: Mapping[K, int], start: int) -> int:
    """Index of the first minimal candidate at or after ``start``, wrapping around (builtins only:
    this runs once per remote request)."""
    get = outstanding.get
    loads = [get(c, 0) for c in candidates]
    m = min(loads)
    try:
        return loads.index(m, start)
    except ValueError:
        return loads.index(m)


class LeastOutstanding:
    """Stateful picker: fewest outstanding, ties rotating round-robin from after the last pick.

    ``start``: where the rotation begins. Many callers that each count only their own requests
    (one frontend per encode pod, each encode worker towards the prefill pool) and all begin at 0
    pick in lockstep: the first request of every frontend goes to the first encoder, the next
    of every frontend to the second, so k frontends send bursts of k to one encoder while the
    others idle. The live pools give each process its own start (``process_rotation_start``), and
    the frontends' encode pools restart at their rank's place in an even spread once they know it
    (``ranked_rotation_start``)."""

    __slots__ = ("_next",)

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start: must be >= 0, got {start}")
        self._next = start

    def restart(self, start: int) -> None:
        """Begin the rotation again at ``start`` (a picker that learnt its rank among its peers,
        ``ranked_rotation_start``)."""
        if start < 0:
            raise ValueError(f"start: must be >= 0, got {start}")
        self._next = start

    def pick(self, candidates: Sequence[K], outstanding: Mapping[K, int]) -> K:
        n = len(candidates)
        if n == 0:
            raise ValueError("LeastOutstanding.pick: no candidates")
        i = _pick_index(candidates, outstanding, self._next % n)
        self._next = i + 1
        return candidates[i]


def spread_rotation_starts(candidates: int, pickers: int) -> list[int]:
    """Rotation starts for ``pickers`` pickers over ``candidates``, spread evenly (0, n/k, 2n/k, ...).

    Why: the twin's frontends stand for live ones that take these starts by their rank among the
    deployment's frontends (``ranked_rotation_start``; with the ``kubernetes`` discovery backend,
    which does not list them, each draws a hash of its pod and process instead,
    ``process_rotation_start``). Hashing fixed names in the twin instead ("frontend-0", "frontend-1", ...) put
    all three frontends of the 6-encoder all-local trial at the same start (all 4 mod 6): the twin
    modelled the lockstep this rotation exists to avoid, and read that trial's mean TTFT 10 % over
    the cluster's (runs 21-25). An even spread is the no-lockstep case; over 20 random draws the
    twin's mean TTFT of that trial lies within 1 % of it."""
    if candidates < 1 or pickers < 1:
        raise ValueError(f"spread_rotation_starts: need candidates and pickers >= 1, got {candidates}, {pickers}")
    return [ranked_rotation_start(i, pickers, candidates) for i in range(pickers)]


def ranked_rotation_start(rank: int, pickers: int, candidates: int) -> int:
    """The start of picker ``rank`` of ``pickers`` over ``candidates``: its place in the even spread
    (``spread_rotation_starts``), which a live picker takes once it knows its rank among its peers
    (the frontends rank themselves through discovery, ``workers.frontend_rank``).

    Why: a start hashed from the process (``process_rotation_start``) is a fresh draw on every
    roll-out, and where frontends share the encode workers the draw moved a trial's P99 TTFT across
    the whole 10 % bar in both directions (the LLaVA example's all-local trial on the cluster read
    0.76-1.19 of the twin's median over draws, runs 21-26). Ranked, every roll-out starts at the
    spread, the twin's starts. The rotations then move with each frontend's own requests, so the
    phases drift from it (run 27 read that trial at 0.96 of the median, 0.79 of the spread's)."""
    if not 0 <= rank < pickers or candidates < 1:
        raise ValueError(f"ranked_rotation_start: need 0 <= rank < pickers and candidates >= 1, "
                         f"got rank {rank}, pickers {pickers}, candidates {candidates}")
    return rank * candidates // pickers


def process_rotation_start(identity: str) -> int:
    """A rotation start for ``LeastOutstanding`` that differs between processes (a stable hash of
    ``identity``, e.g. the pod's name and the process id), so pickers that cannot see each other's
    counts do not start in lockstep."""
    return zlib.crc32(identity.encode()) & 0xFFFF


def drawn_rotation_starts(pickers: int, draws: int, seed: int = 1) -> list[list[int]]:
    """``draws`` sets of rotation starts for ``pickers`` pickers, each start drawn as a live
    frontend draws its own (``process_rotation_start`` of an identity; here a seeded random one,
    as the twin cannot know the pods' and processes' names). Where the even spread
    (``spread_rotation_starts``) is one no-lockstep case, these are the roll-outs a live
    deployment may draw: the twin's prediction of a cluster trial takes its median over them
    (``tuning.agreement``)."""
    rng = random.Random(seed)
    return [[process_rotation_start(f"{rng.getrandbits(64):x}") for _ in range(pickers)] for _ in range(draws)]
