"""How configurations are ranked: the objective value and the lexicographic tie-break.

The paper ranks by throughput and breaks ties among configurations of *comparable* throughput
by mean TTFT, then mean TPOT. "Comparable" is made concrete by ``rel_tol``: every result whose
objective is within ``rel_tol`` (relative) of the best is a tie, and the tie is broken by the
lowest mean TTFT, then the lowest mean TPOT. With ``rel_tol=0`` the order is strictly
lexicographic. ``goodput@<tier>`` ranks by goodput at that SLO tier instead of throughput
(no peer system does that; it is what an SLO-bound operator actually wants).

Before TTFT, a tie goes to the baseline configuration when it is among the tied (``prefer``: the
tuner passes B = 1 and s = 1, the Dynamo-style mechanisms; ``Candidate.is_baseline``). Why: the
issue's rule is that HAS falls back to the baseline "when nothing else pays", and a win inside the
tie tolerance is not evidence that micro-batching or a local prefill pays. The twin's goodput
errors against the GPU are an order larger than the tolerance: at 8.5 req/s on one H100 the twin
put E1 P1 D1 B 9 s 0.5 within 0.3 % of B 1 s 1 with the lower TTFT, and served (run 35) it read
6.91 req/s of moderate goodput against B 1 s 1's 8.08.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from easerve_operator.tuning.runners import TrialMetrics

DEFAULT_TIE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Objective:
    """``throughput`` or ``goodput@<tier>``."""

    kind: str  # "throughput" | "goodput"
    tier: str | None = None

    @classmethod
    def parse(cls, text: str, tiers: Sequence[str] | None = None) -> Objective:
        if text == "throughput":
            return cls("throughput")
        if text.startswith("goodput@") and len(text) > len("goodput@"):
            tier = text.split("@", 1)[1]
            if tiers is not None and tier not in tiers:
                raise ValueError(f"objective: tier '{tier}' is not in spec.slo.tiers {list(tiers)}")
            return cls("goodput", tier)
        raise ValueError(f"objective: expected 'throughput' or 'goodput@<tier>', got '{text}'")

    def __str__(self) -> str:
        return "throughput" if self.kind == "throughput" else f"goodput@{self.tier}"

    def value(self, m: TrialMetrics) -> float:
        """The number to maximise (req/s)."""
        if self.kind == "throughput":
            return m.throughput
        assert self.tier is not None
        if self.tier not in m.goodput:
            raise KeyError(f"trial metrics have no goodput for tier '{self.tier}' (have {sorted(m.goodput)})")
        return m.goodput[self.tier]


T = TypeVar("T")


def select_best(
    items: Sequence[T],
    metrics: Callable[[T], TrialMetrics],
    objective: Objective,
    rel_tol: float = DEFAULT_TIE_TOLERANCE,
    prefer: Callable[[T], bool] | None = None,
) -> T | None:
    """The winner of ``items`` under the lexicographic rule (``None`` if empty).

    Among the items whose objective is within ``rel_tol`` of the best objective, pick one that
    ``prefer`` marks (the baseline configuration) if any, then the lowest mean TTFT, then the
    lowest mean TPOT, then the highest objective; remaining exact ties keep the earliest item
    (stable), so the result never depends on dict or set order.
    """
    if not items:
        return None
    if rel_tol < 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")
    vals = [objective.value(metrics(i)) for i in items]
    best = max(vals)
    floor = best - abs(best) * rel_tol
    tied = [(idx, it) for idx, (it, v) in enumerate(zip(items, vals, strict=True)) if v >= floor]
    idx, winner = min(
        tied,
        key=lambda p: (
            not (prefer is not None and prefer(p[1])),
            metrics(p[1]).ttft_mean,
            metrics(p[1]).tpot_mean,
            -vals[p[0]],
            p[0],
        ),
    )
    return winner


def rank(
    items: Sequence[T],
    metrics: Callable[[T], TrialMetrics],
    objective: Objective,
    rel_tol: float = DEFAULT_TIE_TOLERANCE,
    prefer: Callable[[T], bool] | None = None,
) -> list[T]:
    """All items best-first by repeatedly applying ``select_best`` (stable, O(n²), n ≤ budget)."""
    rest = list(items)
    out: list[T] = []
    while rest:
        w = select_best(rest, metrics, objective, rel_tol, prefer)
        assert w is not None
        i = next(k for k, x in enumerate(rest) if x is w)
        out.append(rest.pop(i))
    return out
