"""HAS Stage 1: profile each stage once, score every allocation, prune, seed the survivors.

WHY it works (paper §3.1): the first-order effect of the allocation is monotonic and follows
from per-stage capacity alone. If one stage is starved at the target rate Λ, no choice of B or s
saves the pipeline, so such allocations are discarded without ever being deployed; only the
non-monotonic (B, s) surface of the survivors needs end-to-end trials (Stage 2).

Definitions (issue 5; the paper's Eq. 4 and Algorithm 1 are missing from our copy):

- C_E: one encode worker's saturation throughput, found by doubling B from 1 until the gain
  is below 5%; C_P(tp), C_D(tp): one prefill / decode worker's capacity at TP ``tp``.
- Cap_E = n_E·C_E; Cap_P = n_P·C_P + n_L·α·C_P; Cap_D = n_D·C_D. n_L is the number of local
  prefill workers: ⌊n_E / local_tp⌋ when local prefill is allowed (one worker per encode GPU
  when the backbone fits one GPU; one per ``local_tp`` encode GPUs when it needs TP
  ``local_tp``, as on the twin), else 0. An all-local allocation (n_P = 0, see ``space``)
  gets its prefill capacity from the n_L·α·C_P term alone; s is then fixed at 0 and s* = 0.
- ρ_x = Λ / Cap_x; score = max_x ρ_x (lower is better).
- keep every allocation that is not saturated (score ≤ 1: each stage carries Λ); of the rest,
  keep those with score ≤ 1.2 × best score, up to K = 3 survivors in all (equal scores are
  ordered by the other stages' load ratios, largest first: see ``score_allocations``).

Why unsaturated allocations are never pruned (issue 13, must-hold 6): below saturation every
such allocation delivers Λ in steady state, and what separates them is latency (queueing and
service time: a TP-4 decode worker emits tokens faster and so shortens the drain), which
per-stage capacities cannot see. The capacity score only ranks what it can: starvation. On the
twin, image example at Λ = 3, the old rule (top K by score) pruned 2E-1P(tp2)-1D(tp4), the
exhaustive best, as "beyond top K" although its score was 0.71.
- seeds: B ∈ [1, B_max(a)], B_max(a) = ⌈Λ / n_E⌉; s centred on
  s*(a) = C_remote / (C_remote + C_local) with C_remote = n_P·C_P, C_local = n_L·α·C_P,
  window ±0.2 clipped to [0, 1].

α defaults to ``DEFAULT_ALPHA`` = 0.3 when the profiler does not know it: the paper's running
example gives local prefill 30% of the encode GPU's SMs, and prefill throughput scales roughly
with SMs, so a local worker delivers about 0.3 of a remote worker's capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from easerve_operator.tuning.runners import Profiler
from easerve_operator.tuning.space import Alloc, SearchSpace, local_workers, round_s, s_grid, snap_s

DEFAULT_ALPHA = 0.3
SATURATION_GAIN = 0.05
PRUNE_FACTOR = 1.2
TOP_K = 3
SATURATION = 1.0
S_WINDOW = 0.2
MAX_PROFILE_BATCH = 256


@dataclass(frozen=True)
class StageCapacities:
    """Stage 1's measurements (requests/s) and what they cost (device seconds)."""

    c_e: float
    b_sat: int
    encode_curve: tuple[tuple[int, float], ...]
    c_p: dict[int, float]
    c_d: dict[int, float]
    alpha: float
    alpha_source: str
    cost_s: dict[str, float] = field(default_factory=dict)

    @property
    def parallel_cost_s(self) -> float:
        """Device time with the three profiles run concurrently on disjoint GPUs (the max)."""
        return max(self.cost_s.get(k, 0.0) for k in ("encode", "prefill", "decode"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "c_e": self.c_e,
            "b_sat": self.b_sat,
            "encode_curve": [list(p) for p in self.encode_curve],
            "c_p": {str(k): v for k, v in self.c_p.items()},
            "c_d": {str(k): v for k, v in self.c_d.items()},
            "alpha": self.alpha,
            "alpha_source": self.alpha_source,
            "cost_s": dict(self.cost_s),
            "parallel_cost_s": self.parallel_cost_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageCapacities:
        return cls(
            c_e=float(d["c_e"]),
            b_sat=int(d["b_sat"]),
            encode_curve=tuple((int(b), float(v)) for b, v in d["encode_curve"]),
            c_p={int(k): float(v) for k, v in d["c_p"].items()},
            c_d={int(k): float(v) for k, v in d["c_d"].items()},
            alpha=float(d["alpha"]),
            alpha_source=str(d["alpha_source"]),
            cost_s={str(k): float(v) for k, v in d.get("cost_s", {}).items()},
        )


def profile_encode(
    probe: Callable[[int], tuple[float, float]],
    gain: float = SATURATION_GAIN,
    max_batch: int = MAX_PROFILE_BATCH,
) -> tuple[float, int, tuple[tuple[int, float], ...], float]:
    """Double B from 1 until throughput improves by less than ``gain``.

    Returns (C_E, B at saturation, the measured curve, total cost). C_E is the best throughput
    seen; the saturation B is the last B that still improved by at least ``gain``.
    """
    curve: list[tuple[int, float]] = []
    cost = 0.0
    b = 1
    thr, c = probe(b)
    cost += c
    curve.append((b, thr))
    b_sat = 1
    while b * 2 <= max_batch:
        nxt, c = probe(b * 2)
        cost += c
        curve.append((b * 2, nxt))
        if thr <= 0 or nxt < thr * (1.0 + gain):
            break
        b, thr, b_sat = b * 2, nxt, b * 2
    c_e = max(v for _, v in curve)
    return c_e, b_sat, tuple(curve), cost


def profile_stages(
    profiler: Profiler, tps: Sequence[int], *, clock: Callable[[], float] = time.perf_counter
) -> tuple[StageCapacities, float]:
    """Run the encode, prefill and decode profiles concurrently; returns (capacities, wall s).

    The three profiles touch disjoint workers, so they run on three threads (on a cluster: three
    disjoint GPU subsets at once). ``clock`` only measures the wall time reported to the user.
    """

    def enc() -> tuple[float, int, tuple[tuple[int, float], ...], float]:
        def probe(b: int) -> tuple[float, float]:
            p = profiler.encode_throughput(b)
            return p.value, p.cost_s

        return profile_encode(probe)

    def per_tp(fn: Callable[[int], Any]) -> tuple[dict[int, float], float]:
        vals: dict[int, float] = {}
        cost = 0.0
        for tp in tps:
            p = fn(tp)
            vals[tp] = p.value
            cost += p.cost_s
        return vals, cost

    t0 = clock()
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="has-profile") as pool:
        fe = pool.submit(enc)
        fp = pool.submit(per_tp, profiler.prefill_capacity)
        fd = pool.submit(per_tp, profiler.decode_capacity)
        c_e, b_sat, curve, cost_e = fe.result()
        c_p, cost_p = fp.result()
        c_d, cost_d = fd.result()
    wall = clock() - t0
    alpha = profiler.local_prefill_efficiency()
    source = "profile"
    if alpha is None:
        alpha, source = DEFAULT_ALPHA, "default"
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"local prefill efficiency α must be in [0, 1], got {alpha}")
    caps = StageCapacities(
        c_e=c_e,
        b_sat=b_sat,
        encode_curve=curve,
        c_p=c_p,
        c_d=c_d,
        alpha=float(alpha),
        alpha_source=source,
        cost_s={"encode": cost_e, "prefill": cost_p, "decode": cost_d},
    )
    return caps, wall


@dataclass(frozen=True)
class Stage1Row:
    """One allocation's line of the Stage-1 table."""

    alloc: Alloc
    cap_e: float
    cap_p: float
    cap_d: float
    rho: dict[str, float]
    score: float
    bottleneck: str
    kept: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "allocation": self.alloc.label,
            "alloc": self.alloc.to_dict(),
            "cap_e": self.cap_e,
            "cap_p": self.cap_p,
            "cap_d": self.cap_d,
            "rho": dict(self.rho),
            "score": self.score,
            "bottleneck": self.bottleneck,
            "kept": self.kept,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stage1Row:
        return cls(
            alloc=Alloc.from_dict(d["alloc"]),
            cap_e=float(d["cap_e"]),
            cap_p=float(d["cap_p"]),
            cap_d=float(d["cap_d"]),
            rho={str(k): float(v) for k, v in d["rho"].items()},
            score=float(d["score"]),
            bottleneck=str(d["bottleneck"]),
            kept=bool(d["kept"]),
            reason=str(d["reason"]),
        )


def n_local(a: Alloc, local_prefill: bool, local_tp: int = 1) -> int:
    """Local prefill workers of allocation ``a`` (the space's rule, ``space.local_workers``)."""
    return local_workers(a.encode, local_prefill, local_tp)


def capacities(
    a: Alloc, caps: StageCapacities, local_prefill: bool, local_tp: int = 1
) -> tuple[float, float, float]:
    """(Cap_E, Cap_P, Cap_D) of allocation ``a``.

    An all-local allocation (prefill replicas 0) has Cap_P = n_L·α·C_P from local prefill alone;
    its prefill TP is the space's smallest feasible TP, the C_P that α is measured against.
    """
    c_p = caps.c_p[a.prefill_tp]
    cap_e = a.encode * caps.c_e
    cap_p = a.prefill * c_p + n_local(a, local_prefill, local_tp) * caps.alpha * c_p
    cap_d = a.decode * caps.c_d[a.decode_tp]
    return cap_e, cap_p, cap_d


def _rho(rate: float, cap: float) -> float:
    return math.inf if cap <= 0 else rate / cap


def score_allocations(
    allocs: Sequence[Alloc],
    caps: StageCapacities,
    rate: float,
    *,
    local_prefill: bool = True,
    local_tp: int = 1,
    prune_factor: float = PRUNE_FACTOR,
    top_k: int = TOP_K,
    saturation: float = SATURATION,
) -> list[Stage1Row]:
    """Score every allocation (max ρ); keep the unsaturated ones and the best K within 1.2× best.

    An allocation with score ≤ ``saturation`` (every stage can carry Λ) is always kept: below
    saturation the allocations differ by latency, not capacity, so the score cannot rank them
    (see the module docstring). The others are pruned beyond ``prune_factor``× the best score
    or once K allocations survive. Rows come back best score first. Equal scores (allocations sharing the same starved stage,
    common when one decode worker bounds several layouts) are ordered by the remaining load
    ratios, largest first (leximax): of two allocations with the same bottleneck, the one whose
    next-busiest stage has more headroom is better balanced. Remaining ties go to fewer GPUs,
    then the label, so the table is deterministic.
    """
    if rate <= 0:
        raise ValueError(f"target rate Λ must be > 0, got {rate}")
    scored: list[tuple[float, Alloc, tuple[float, float, float], dict[str, float]]] = []
    for a in allocs:
        ce, cp, cd = capacities(a, caps, local_prefill, local_tp)
        rho = {"E": _rho(rate, ce), "P": _rho(rate, cp), "D": _rho(rate, cd)}
        scored.append((max(rho.values()), a, (ce, cp, cd), rho))
    scored.sort(key=lambda t: (t[0], sorted(t[3].values(), reverse=True), t[1].gpus, t[1].label))
    if not scored:
        return []
    best = scored[0][0]
    rows: list[Stage1Row] = []
    kept = 0
    for score, a, (ce, cp, cd), rho in scored:
        bottleneck = max(rho, key=lambda k: rho[k])
        if score <= saturation:
            kept += 1
            ok, why = True, f"rank {kept}: not saturated (score {score:.3f} <= {saturation:g})"
        elif score > prune_factor * best:
            ok, why = False, f"score {score:.3f} > {prune_factor:g}x best {best:.3f} ({bottleneck} starved)"
        elif kept >= top_k:
            ok, why = False, f"within {prune_factor:g}x of best but beyond top K={top_k}"
        else:
            kept += 1
            ok, why = True, f"rank {kept}: score {score:.3f} <= {prune_factor:g}x best {best:.3f}"
        rows.append(Stage1Row(a, ce, cp, cd, rho, score, bottleneck, ok, why))
    return rows


@dataclass(frozen=True)
class SeedRange:
    """A survivor's Stage-2 ranges and its analytical optimum (the enqueued seed)."""

    alloc: Alloc
    b_max: int
    b_seed: int
    s_star: float
    s_lo: float
    s_hi: float
    s_seed: float

    def s_values(self, step: float) -> tuple[float, ...]:
        return s_grid(step, self.s_lo, self.s_hi)

    def to_dict(self) -> dict[str, Any]:
        return {
            "allocation": self.alloc.label,
            "alloc": self.alloc.to_dict(),
            "b_max": self.b_max,
            "b_seed": self.b_seed,
            "s_star": self.s_star,
            "s_lo": self.s_lo,
            "s_hi": self.s_hi,
            "s_seed": self.s_seed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SeedRange:
        return cls(
            alloc=Alloc.from_dict(d["alloc"]),
            b_max=int(d["b_max"]),
            b_seed=int(d["b_seed"]),
            s_star=float(d["s_star"]),
            s_lo=float(d["s_lo"]),
            s_hi=float(d["s_hi"]),
            s_seed=float(d["s_seed"]),
        )


def b_max(rate: float, n_encode: int) -> int:
    """B_max(a) = ⌈Λ / n_E⌉: a worker is unlikely to fill batches larger than its arrival rate."""
    return max(1, math.ceil(rate / n_encode - 1e-9))


def s_star(a: Alloc, caps: StageCapacities, local_prefill: bool, local_tp: int = 1) -> float:
    """s*(a) = C_remote / (C_remote + C_local): the offload ratio that balances both paths."""
    c_p = caps.c_p[a.prefill_tp]
    remote = a.prefill * c_p
    local = n_local(a, local_prefill, local_tp) * caps.alpha * c_p
    return 1.0 if remote + local <= 0 else remote / (remote + local)


def seed_range(
    a: Alloc, caps: StageCapacities, rate: float, space: SearchSpace, window: float = S_WINDOW
) -> SeedRange:
    """B range, s window and the seed point of survivor ``a`` on ``space``'s grid.

    B_max is clipped to the space's ``max_batch``. The seed B is min(B_max, B_sat): larger
    batches than the encoder's saturation point buy no throughput. The s window [s*−0.2, s*+0.2]
    is clipped to [0, 1] and to grid values; the seed s is the grid value nearest s*. An
    allocation the space gives one s only (1.0 without local prefill, 0.0 when all-local) gets
    that s: a window around s* could hold values the space (and the spec) refuse.
    """
    bm = min(b_max(rate, a.encode), space.max_batch)
    b_seed = max(1, min(bm, caps.b_sat))
    only = space.s_values(a)
    if len(only) == 1:
        return SeedRange(a, bm, b_seed, only[0], only[0], only[0], only[0])
    st = s_star(a, caps, True, space.local_tp)
    grid = s_grid(space.s_step, max(0.0, st - window), min(1.0, st + window))
    if not grid:  # window narrower than a grid step: take the nearest grid value
        grid = (snap_s(st, space.s_step),)
    seed = min(grid, key=lambda s: (abs(s - st), s))
    return SeedRange(a, bm, b_seed, round_s(st), grid[0], grid[-1], seed)


@dataclass(frozen=True)
class Stage1Result:
    capacities: StageCapacities
    rows: tuple[Stage1Row, ...]
    seeds: tuple[SeedRange, ...]
    rate: float
    wall_s: float = 0.0

    @property
    def survivors(self) -> tuple[Alloc, ...]:
        return tuple(s.alloc for s in self.seeds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "capacities": self.capacities.to_dict(),
            "table": [r.to_dict() for r in self.rows],
            "seeds": [s.to_dict() for s in self.seeds],
            "kept": len(self.seeds),
            "of": len(self.rows),
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stage1Result:
        return cls(
            capacities=StageCapacities.from_dict(d["capacities"]),
            rows=tuple(Stage1Row.from_dict(r) for r in d["table"]),
            seeds=tuple(SeedRange.from_dict(s) for s in d["seeds"]),
            rate=float(d["rate"]),
            wall_s=float(d.get("wall_s", 0.0)),
        )


def decide(
    caps: StageCapacities,
    space: SearchSpace,
    rate: float,
    *,
    prune_factor: float = PRUNE_FACTOR,
    top_k: int = TOP_K,
    saturation: float = SATURATION,
    wall_s: float = 0.0,
) -> Stage1Result:
    """Score, prune and seed over ``space``'s allocations from measured capacities (pure)."""
    missing = sorted({a.prefill_tp for a in space.allocations} - set(caps.c_p)) + sorted(
        {a.decode_tp for a in space.allocations} - set(caps.c_d)
    )
    if missing:
        raise ValueError(f"stage capacities lack TP degrees {missing} used by the space")
    rows = score_allocations(
        space.allocations,
        caps,
        rate,
        local_prefill=space.local_prefill,
        local_tp=space.local_tp,
        prune_factor=prune_factor,
        top_k=top_k,
        saturation=saturation,
    )
    seeds = tuple(seed_range(r.alloc, caps, rate, space) for r in rows if r.kept)
    return Stage1Result(caps, tuple(rows), seeds, rate, wall_s)


def run_stage1(
    profiler: Profiler,
    space: SearchSpace,
    rate: float,
    *,
    prune_factor: float = PRUNE_FACTOR,
    top_k: int = TOP_K,
    saturation: float = SATURATION,
    clock: Callable[[], float] = time.perf_counter,
) -> Stage1Result:
    """Profile (concurrently), then ``decide``."""
    tps = sorted({a.prefill_tp for a in space.allocations} | {a.decode_tp for a in space.allocations})
    caps, wall = profile_stages(profiler, tps, clock=clock)
    return decide(
        caps, space, rate, prune_factor=prune_factor, top_k=top_k, saturation=saturation, wall_s=wall
    )
