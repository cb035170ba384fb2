"""The operator's own Prometheus metrics (served by ``easerve operator --metrics-port``)."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("easerve_operator_reconciles_total", "Owner reconciliations by result", ["result"])
CHILD_WRITES = Counter(
    "easerve_operator_child_writes_total", "Server-side applies of child objects", ["kind"]
)
REPAIRS = Counter(
    "easerve_operator_repairs_total", "Children re-applied after deletion or hand edits", ["kind"]
)
STATUS_WRITES = Counter("easerve_operator_status_writes_total", "Status patches written")
RECONCILE_SECONDS = Histogram(
    "easerve_operator_reconcile_seconds",
    "Time of one owner reconciliation (parse, render, applies, status)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
SEARCHES = Counter("easerve_operator_searches_total", "HAS searches finished, by outcome", ["outcome"])
TRIALS = Counter(
    "easerve_operator_trials_total",
    "HAS Stage-2 trials by outcome (complete|failed|cached) and where they ran (twin|cluster)",
    ["outcome", "trials_on"],
)
SEARCH_SECONDS = Histogram(
    "easerve_operator_search_seconds",
    "Wall time of one HAS search (profiling and trials)",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
)
