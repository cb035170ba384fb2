"""Pure runtime policies: no I/O, no clock (``now`` is passed in), driven by workers and the twin.

Import the concrete modules (``policies.batcher``, ``policies.router``, ``policies.envelope``,
``policies.partition``, ``policies.omni``); this package re-exports the most used names.
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
