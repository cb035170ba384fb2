"""The SM-partition knee table a latency profile implies.

`easerve profile-partition` measures this table on a GPU; without a measurement, the sim engine,
the twin and the partition controller all use the table the profile's encode-vs-SM curve gives,
through this one function.
"""

from __future__ import annotations

from typing import Protocol

from easerve_runtime.policies.partition import PartitionTable, default_ladder

TABLE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
TABLE_EPSILON = 0.1  # the default of spec.smPartition.epsilon


class EncodeCurve(Protocol):
    def encode_s(self, batch: int, sm_share: float = 1.0, /) -> float: ...


def partition_table(curve: EncodeCurve, total_sms: int, epsilon: float = TABLE_EPSILON) -> PartitionTable:
    """Per level of the default ladder, the largest batch within (1+epsilon) of the full GPU."""
    lat = {
        sms: {b: curve.encode_s(b, sms / total_sms) for b in TABLE_BATCHES}
        for sms in default_ladder(total_sms)
    }
    return PartitionTable.from_latencies(total_sms, lat, epsilon=epsilon)
