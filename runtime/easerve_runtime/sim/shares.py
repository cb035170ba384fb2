"""SM shares on an encode GPU that also hosts a local prefill worker, per ``spec.smPartition``.

Which policy runs is not decided here: ``policies.sm_policy.partition_policy`` (the same factory
the pod's partition controller and the omni engine use) answers it; this module turns its answer
into the twin's (share, dilation) pairs.

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

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.policies.sm_policy import PolicyKind, SMPolicy, partition_policy, policy_kind
from easerve_runtime.profiles.partition import partition_table
from easerve_runtime.sim.latency import StageModel

NONE_ENCODE_DILATION = 30.4 / 8.14
NONE_PREFILL_DILATION = 19.4 / 13.8


class ShareModel:
    """The twin's adapter over the spec's SM policy (``policies.sm_policy.partition_policy``)."""

    def __init__(self, spec: EPDDeploymentSpec, model: StageModel, colocated: bool) -> None:
        self.total = model.total_sms
        self.colocated = colocated
        self.policy = self.policy_for(spec, model) if colocated else SMPolicy(PolicyKind.NONE, self.total)
        self.split = self.policy.split
        self.splits: dict[int, int] = {}  # encode SMs -> micro-batches (for reports)

    @staticmethod
    def policy_for(spec: EPDDeploymentSpec, model: StageModel) -> SMPolicy:
        """The spec's policy on one of the twin's GPUs; the dynamic table comes from the profile
        (what ``easerve profile-partition`` would measure on the sim engine), as the controller
        builds it when no measured table is mounted."""
        table = None
        if policy_kind(spec) is PolicyKind.ENCODE_BATCH_SPLIT:
            table = partition_table(model, model.total_sms, epsilon=spec.sm_partition.epsilon)
        return partition_policy(spec, model.total_sms, table=table)

    @property
    def mode(self) -> PolicyKind:
        return self.policy.kind

    def encode_share(self, items: int, local_active: bool) -> tuple[float, float]:
        if not self.colocated:
            return 1.0, 1.0
        if self.split is not None:
            sp = self.split.decide(items)
            self.splits[sp.primary_sms] = self.splits.get(sp.primary_sms, 0) + 1
            return sp.primary_sms / self.total, 1.0
        if self.policy.kind is PolicyKind.STATIC:
            return self.policy.static_share, 1.0
        return 1.0, (NONE_ENCODE_DILATION if local_active else 1.0)

    def local_share(self, items: int | None, local_active: bool) -> tuple[float, float]:
        """The local worker's share while a micro-batch of ``items`` runs (None: encoder idle)."""
        if self.split is not None:
            sp = self.split.idle() if items is None else self.split.decide(items)
            return sp.partner_sms / self.total, 1.0
        if self.policy.kind is PolicyKind.STATIC:
            return 1.0 - self.policy.static_share, 1.0
        return 1.0, (1.0 if items is None else NONE_PREFILL_DILATION)
