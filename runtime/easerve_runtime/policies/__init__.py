"""Pure runtime policies: no I/O, no clock (``now`` is passed in), driven by workers and the twin.

Import the concrete modules (``policies.batcher``, ``policies.router``, ``policies.envelope``,
``policies.partition``, ``policies.omni``); this package re-exports the most used names.

The decisions built from these blocks live here once too, for the live workers and the twin
alike (docs/policies.md, "Shared stage decisions"): ``policies.prefill_batch`` (prefill token
budget), ``policies.decode_admission`` (sequence cap and KV memory), ``policies.post_encode``
(route, pick, group per destination) and ``policies.sm_policy`` (spec -> SM-partition policy).
"""

from easerve_runtime.policies.batcher import (
    Batcher,
    Dispatch,
    DispatchReason,
    EagerBatcher,
    FixedTimeoutBatcher,
    PoissonGapBatcher,
    RateEstimator,
    make_batcher,
)
from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding, Route, least_outstanding

__all__ = [
    "Batcher",
    "DeficitRouter",
    "Dispatch",
    "DispatchReason",
    "EagerBatcher",
    "FixedTimeoutBatcher",
    "LeastOutstanding",
    "PoissonGapBatcher",
    "RateEstimator",
    "Route",
    "least_outstanding",
    "make_batcher",
]
