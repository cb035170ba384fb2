"""The operator's own Prometheus metrics (served by ``easerve operator --metrics-port``)."""

from prometheus_client import Counter

RECONCILES = Counter("easerve_operator_reconciles_total", "Owner reconciliations by result", ["result"])
CHILD_WRITES = Counter(
    "easerve_operator_child_writes_total", "Server-side applies of child objects", ["kind"]
)
REPAIRS = Counter(
    "easerve_operator_repairs_total", "Children re-applied after deletion or hand edits", ["kind"]
)
STATUS_WRITES = Counter("easerve_operator_status_writes_total", "Status patches written")
