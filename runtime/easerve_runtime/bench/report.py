"""Turn load-client outcomes into the JSON report (the twin's ``summarize`` plus live-only checks)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from easerve_runtime.api import SLOSpec, SLOTier
from easerve_runtime.bench.load import Outcome
from easerve_runtime.workload.metrics import percentile, summarize

_NO_SLO = SLOSpec(tiers=[SLOTier(name="any", ttft_seconds=3600, tpot_ms=60_000)], objective="any")


def _clean(x: Any) -> Any:
    """JSON has no NaN: report missing statistics as null."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def report(outcomes: list[Outcome], duration: float, slo: SLOSpec | None = None) -> dict[str, Any]:
    """throughput, ttft/tpot {mean, p50, p99}, completed, failed; goodput per tier if ``slo``."""
    records = [o.record for o in outcomes]
    out = summarize(records, slo or _NO_SLO, duration=duration)
    if slo is None:
        for k in ("goodput", "attainment", "objective"):
            out.pop(k, None)
    ok = [o for o in outcomes if o.record.ok]
    out["output_tokens"] = sum(o.record.output_tokens for o in ok)
    out["token_count_mismatches"] = sum(1 for o in ok if o.record.output_tokens != o.expected_tokens)
    out["routes"] = dict(Counter(o.record.route or "unknown" for o in ok))
    errors = Counter((o.record.error or "")[:120] for o in outcomes if not o.record.ok)
    out["errors"] = dict(errors.most_common(5))
    lags = [o.send_lag_s for o in outcomes]
    if lags:  # how far this client ran behind its schedule (TTFT counts from the schedule)
        out["send_lag"] = {"p99": percentile(lags, 99), "max": max(lags)}
    return dict(_clean(out))
