"""Throughput, TTFT/TPOT statistics and goodput per SLO tier, from per-request records.

Goodput (paper Eq. 1) is the SLO-compliant request rate: a request counts for a tier when its
own TTFT is within the tier's TTFT bound and its own TPOT within the tier's TPOT bound; goodput
is that count over the run's duration. Failed requests count for no tier. The duration is, by
default, from the first arrival to the last completion (the makespan), so an overloaded system
that drains its backlog long after the last arrival is charged for it.

Kept free of asyncio and numpy so the live client and the twin report with the same code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from easerve_runtime.api import SLOSpec, SLOTier
from easerve_runtime.workload.request import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {"mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99)}


def is_good(rec: RequestRecord, tier: SLOTier) -> bool:
    return rec.ok and rec.ttft_s <= tier.ttft_seconds and rec.tpot_s * 1000.0 <= tier.tpot_ms


def run_duration(records: Iterable[RequestRecord]) -> float:
    recs = list(records)
    if not recs:
        return 0.0
    start = min(r.arrival_s for r in recs)
    ends = [r.finish_s for r in recs if r.finish_s is not None]
    return (max(ends) - start) if ends else 0.0


def summarize(
    records: Sequence[RequestRecord], slo: SLOSpec, duration: float | None = None
) -> dict[str, Any]:
    """The run's metrics as a JSON-ready dict.

    Keys: ``requests``, ``completed``, ``failed``, ``duration_s``, ``throughput`` (completed req/s),
    ``ttft`` and ``tpot`` ({mean, p50, p99} seconds), ``ttft_mean``/``ttft_p99``/``tpot_mean``/
    ``tpot_p99`` (flat copies for tables), ``goodput`` ({tier name: req/s}), ``attainment``
    ({tier name: fraction of all requests that were good}), ``objective`` (the spec's tier), and
    ``token2_gap`` ({mean, p50, p99} seconds from the first token to the second) where the records
    carry the second token's time.
    """
    ok = [r for r in records if r.ok]
    dur = run_duration(records) if duration is None else duration
    ttft = _stats([r.ttft_s for r in ok])
    tpot = _stats([r.tpot_s for r in ok])
    gaps = [g for g in (r.token2_gap_s for r in ok) if g is not None]
    n = len(records)
    good = {t.name: sum(1 for r in ok if is_good(r, t)) for t in slo.tiers}
    return {
        "requests": n,
        "completed": len(ok),
        "failed": n - len(ok),
        "duration_s": dur,
        "throughput": (len(ok) / dur) if dur > 0 else 0.0,
        "ttft": ttft,
        "tpot": tpot,
        "ttft_mean": ttft["mean"],
        "ttft_p99": ttft["p99"],
        "tpot_mean": tpot["mean"],
        "tpot_p99": tpot["p99"],
        "goodput": {k: (v / dur if dur > 0 else 0.0) for k, v in good.items()},
        "attainment": {k: (v / n if n else 0.0) for k, v in good.items()},
        "objective": slo.objective,
        # present where runs observe the second token (the bench, the twin's disaggregated pipeline)
        **({"token2_gap": _stats(gaps)} if gaps else {}),
    }
