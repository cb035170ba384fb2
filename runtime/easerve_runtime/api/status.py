"""Status of an EPDDeployment: what the operator observed and decided.

Shaped for GitOps tools: ``observedGeneration`` plus conditions that Argo CD, Flux and kstatus
understand. ``Ready``/``Progressing``/``Degraded`` are the human-facing trio; ``Reconciling``
and ``Stalled`` mirror them with kstatus' "abnormal-true" semantics so that ``kstatus`` and
Flux health checks work without custom code.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from easerve_runtime.api.spec import Allocation, Model


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class Reason(StrEnum):
    """Precise condition reasons; each one tells the user what to do next."""

    RECONCILING = "Reconciling"  # children being created/updated
    PODS_NOT_READY = "PodsNotReady"  # children exist, some pods are not ready yet
    ALL_READY = "AllStagesReady"
    INVALID_SPEC = "InvalidSpec"  # the spec breaks a rule; nothing was created
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # pods cannot be scheduled (e.g. GPUs)
    APPLY_FAILED = "ApplyFailed"  # the API server refused a child
    AS_EXPECTED = "AsExpected"


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class StageStatus(Model):
    desired: int = 0
    ready: int = 0


class StagesStatus(Model):
    encode: StageStatus = Field(default_factory=StageStatus)
    prefill: StageStatus = Field(default_factory=StageStatus)
    decode: StageStatus = Field(default_factory=StageStatus)


class EffectiveConfig(Model):
    """The (allocation, B, s) actually deployed, and where it came from."""

    allocation: Allocation
    allocation_label: str = Field(description="Compact E/P/D label, e.g. 2E-1P(tp2)-2D(tp2).")
    batch_bound: int
    offload_ratio: float
    source: Literal["spec", "tuning"] = "spec"


class EPDDeploymentStatus(Model):
    observed_generation: int | None = None
    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    stages: StagesStatus = Field(default_factory=StagesStatus)
    effective: EffectiveConfig | None = None
    ready_summary: str | None = Field(default=None, description="Ready pods per stage, e.g. 2/2,1/1,2/2.")
    config_hash: str | None = Field(default=None, description="Checksum of the runtime ConfigMap in force.")
    tuning: dict[str, Any] | None = Field(default=None, description="Result of the last HAS search.")
