"""SM shares on an encode GPU that also hosts a local prefill worker, per ``spec.smPartition``.

- ``dynamic``: the real ``EncodeBatchSplit`` policy over a ``PartitionTable`` built from the
  profile's encode latency at each SM level of the default ladder (the same numbers the runtime's
  ``easerve profile-partition`` would measure on the sim engine). Encode gets the smallest level
  that covers the micro-batch, local prefill the complement; with no micro-batch in flight local
  prefill gets the whole GPU (``EncodeBatchSplit.idle``).
- ``static``: encode always gets ``staticEncodeSMs``, local prefill the rest.
- ``none``: no isolation: both run on the full GPU and time-slice. We charge the slowdowns measured
  on an H200 when a ViT batch and a prefill shared a GPU on plain streams (ViT 8.14 → 30.4 ms,
  3.7×; prefill 13.8 → 19.4 ms, 1.4×; ../shared/reference/h200-measurements.md), encode's only
  when the local worker is busy at dispatch, prefill's while a micro-batch runs.

With no local prefill worker (s = 1) the encoder always has the whole GPU.
Each answer is ``(share, dilation)``: the SM fraction and a time multiplier.
"""

from __future__ import annotations

from easerve_runtime.api import EPDDeploymentSpec, PartitionMode
from easerve_runtime.policies.partition import EncodeBatchSplit
from easerve_runtime.profiles.partition import partition_table
from easerve_runtime.sim.latency import StageModel

NONE_ENCODE_DILATION = 30.4 / 8.14
NONE_PREFILL_DILATION = 19.4 / 13.8
class ShareModel:
    def __init__(self, spec: EPDDeploymentSpec, model: StageModel, colocated: bool) -> None:
        self.total = model.total_sms
        self.colocated = colocated
        self.mode = PartitionMode(spec.sm_partition.mode) if colocated else PartitionMode.NONE
        self.split: EncodeBatchSplit | None = None
        self.static_share = 1.0
        if self.mode == PartitionMode.DYNAMIC:
            table = partition_table(model, model.total_sms, epsilon=spec.sm_partition.epsilon)
            self.split = EncodeBatchSplit(table)
        elif self.mode == PartitionMode.STATIC:
            sms = spec.sm_partition.static_encode_sms or self.total // 2
            self.static_share = min(sms, self.total) / self.total
        self.splits: dict[int, int] = {}  # encode SMs -> micro-batches (for reports)

    def encode_share(self, items: int, local_active: bool) -> tuple[float, float]:
        if not self.colocated:
            return 1.0, 1.0
        if self.split is not None:
            sp = self.split.decide(items)
            self.splits[sp.primary_sms] = self.splits.get(sp.primary_sms, 0) + 1
            return sp.primary_sms / self.total, 1.0
        if self.mode == PartitionMode.STATIC:
            return self.static_share, 1.0
        return 1.0, (NONE_ENCODE_DILATION if local_active else 1.0)

    def local_share(self, items: int | None, local_active: bool) -> tuple[float, float]:
        """The local worker's share while a micro-batch of ``items`` runs (None: encoder idle)."""
        if self.split is not None:
            sp = self.split.idle() if items is None else self.split.decide(items)
            return sp.partner_sms / self.total, 1.0
        if self.mode == PartitionMode.STATIC:
            return 1.0 - self.static_share, 1.0
        return 1.0, (1.0 if items is None else NONE_PREFILL_DILATION)
