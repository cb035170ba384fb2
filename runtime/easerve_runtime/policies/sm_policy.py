"""Spec -> SM-partition policy: the one place that decides which policy a GPU runs, and with what.

The partition controller (``cli/partition_controller.py``, in the pod), the disaggregated twin
(``sim/shares.py``) and the omni engine (``omni/engine.py``, live and twin) all ask
:func:`partition_policy` instead of each reading ``spec.smPartition`` on its own:

==========================================  =========================  ==================================
deployment                                  policy                     built from
==========================================  =========================  ==================================
``mode: omni-colocated``                    ``bandwidth-throttle``     the omni profile's ``throttle``
disaggregated, no local prefill (s = 1)     ``none``                   (encode owns the GPU)
``smPartition.mode: dynamic``               ``encode-batch-split``     the knee table (measured or from
                                                                       the latency profile)
``smPartition.mode: static``                ``static``                 ``smPartition.staticEncodeSms``
``smPartition.mode: none``                  ``none``                   (plain streams, time-slicing)
==========================================  =========================  ==================================

The table and the throttle parameters are inputs, not read here (this package does no I/O): the
shell loads the ConfigMap table or builds it from the profile, and passes the omni profile's
``throttle`` mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from easerve_runtime.api import DeploymentMode, EPDDeploymentSpec, PartitionMode
from easerve_runtime.policies.partition import (
    DEFAULT_GAMMA,
    BandwidthThrottle,
    EncodeBatchSplit,
    PartitionTable,
)


class PolicyKind(StrEnum):
    ENCODE_BATCH_SPLIT = "encode-batch-split"
    BANDWIDTH_THROTTLE = "bandwidth-throttle"
    STATIC = "static"
    NONE = "none"


@dataclass(frozen=True)
class SMPolicy:
    """The policy one GPU runs: its kind and exactly the object (or SM count) that kind needs."""

    kind: PolicyKind
    total_sms: int
    split: EncodeBatchSplit | None = None
    throttle: BandwidthThrottle | None = None
    static_sms: int | None = None

    def __post_init__(self) -> None:
        need = {
            PolicyKind.ENCODE_BATCH_SPLIT: self.split is not None,
            PolicyKind.BANDWIDTH_THROTTLE: self.throttle is not None,
            PolicyKind.STATIC: self.static_sms is not None,
            PolicyKind.NONE: True,
        }
        if not need[self.kind]:
            raise ValueError(f"policy: {self.kind} needs its parameters")
        if self.static_sms is not None and not 0 < self.static_sms <= self.total_sms:
            raise ValueError(f"static_sms: must be in 1..{self.total_sms}, got {self.static_sms}")

    @property
    def static_share(self) -> float:
        """Encode's SM fraction under ``static`` (1.0 otherwise)."""
        return self.static_sms / self.total_sms if self.static_sms is not None else 1.0


def policy_kind(spec: EPDDeploymentSpec) -> PolicyKind:
    """Which policy the spec asks for (see the module table)."""
    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        return PolicyKind.BANDWIDTH_THROTTLE
    if not spec.has_local_prefill:
        return PolicyKind.NONE
    return {
        PartitionMode.DYNAMIC: PolicyKind.ENCODE_BATCH_SPLIT,
        PartitionMode.STATIC: PolicyKind.STATIC,
        PartitionMode.NONE: PolicyKind.NONE,
    }[PartitionMode(spec.sm_partition.mode)]


def bandwidth_throttle(params: Mapping[str, Any], total_sms: int) -> BandwidthThrottle:
    """HorizonServe's throttle from a profile's ``throttle`` mapping (ladder, s_aggr, b_sat, gamma)."""
    missing = [k for k in ("ladder", "s_aggr", "b_sat") if k not in params]
    if missing:
        raise ValueError(f"throttle: the omni profile's throttle lacks {', '.join(missing)}")
    return BandwidthThrottle(
        ladder=[int(s) for s in params["ladder"]],
        s_aggr=int(params["s_aggr"]),
        total_sms=total_sms,
        b_sat=float(params["b_sat"]),
        gamma=float(params.get("gamma", DEFAULT_GAMMA)),
    )


def partition_policy(
    spec: EPDDeploymentSpec,
    total_sms: int,
    *,
    table: PartitionTable | None = None,
    throttle: Mapping[str, Any] | None = None,
) -> SMPolicy:
    """The SM policy ``spec`` asks for on a GPU of ``total_sms`` SMs.

    ``table``: the knee table (required for ``dynamic``); ``throttle``: the omni profile's
    throttle parameters (required for omni-colocated). Errors name what is missing.
    """
    kind = policy_kind(spec)
    if kind is PolicyKind.ENCODE_BATCH_SPLIT:
        if table is None:
            raise ValueError("table: spec.smPartition.mode dynamic needs a partition table")
        return SMPolicy(kind, total_sms, split=EncodeBatchSplit(table))
    if kind is PolicyKind.STATIC:
        sms = spec.sm_partition.static_encode_sms
        if sms is None:  # the spec rules require it; kept for specs built without validation
            raise ValueError(
                "spec.smPartition.staticEncodeSms: is required when spec.smPartition.mode is static"
            )
        return SMPolicy(kind, total_sms, static_sms=min(int(sms), total_sms))
    if kind is PolicyKind.BANDWIDTH_THROTTLE:
        if throttle is None:
            raise ValueError("throttle: an omni-colocated spec needs the omni profile's throttle parameters")
        return SMPolicy(kind, total_sms, throttle=bandwidth_throttle(throttle, total_sms))
    return SMPolicy(kind, total_sms)
