"""Status of an EPDDeployment: what the operator observed and decided.

Shaped for GitOps tools: ``observedGeneration`` plus conditions that Argo CD, Flux and kstatus
understand. ``Ready``/``Progressing``/``Degraded`` are the human-facing trio; ``Reconciling``
and ``Stalled`` mirror them with kstatus' "abnormal-true" semantics so that ``kstatus`` and
Flux health checks work without custom code.

These models *build* the status the operator writes (``EPDDeploymentStatus.wire()`` is the
patch body) and the CRD's status schema is generated from them, so every written field is in
the schema: nothing the operator writes is pruned by the API server.

``CONDITIONS`` is the one table of condition semantics: situation -> phase -> conditions. The
operator's status rules look rows up in it, docs/api.md prints it, and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    INVALID_SPEC = "InvalidSpec"  # the spec (or metadata.name) breaks a rule; nothing was created
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # pods cannot be scheduled (e.g. GPUs)
    APPLY_FAILED = "ApplyFailed"  # the API server refused a child
    TUNING = "Tuning"  # a HAS search chooses values the spec leaves unset; nothing deployed until it ends
    AS_EXPECTED = "AsExpected"


CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Reconciling", "Stalled")


class Situation(StrEnum):
    """What the operator sees, most severe first: the first that applies picks the table row."""

    INVALID_SPEC = "the spec breaks a rule"
    APPLY_FAILED = "the API server refused a child"
    UNSCHEDULABLE = "pods cannot be scheduled (e.g. GPUs)"
    TUNING = "the first HAS search chooses values the spec leaves unset"
    PROGRESSING = "creating, or rolling out a change"
    READY = "every stage ready at the current generation"


class Message(StrEnum):
    """Which text a condition carries (filled in by the operator from what it observed)."""

    NONE = ""
    PROBLEM = "problem"  # the error, the apply failure, or the scheduler's message
    WAITING = "waiting"  # which stages are not ready yet (the problem when nothing waits)
    NOTHING_CREATED = "nothing is created until the spec is fixed"
    SUMMARY = "summary"  # all stages ready (2/2,1/1,2/2)


@dataclass(frozen=True)
class ConditionRule:
    type: str
    true: bool
    reason: Reason
    message: Message = Message.NONE


@dataclass(frozen=True)
class Row:
    phase: Phase
    conditions: tuple[ConditionRule, ...]


def _row(phase: Phase, *rules: tuple[bool, Reason, Message]) -> Row:
    return Row(phase, tuple(ConditionRule(t, *r) for t, r in zip(CONDITION_TYPES, rules, strict=True)))


_P, _W, _N = Message.PROBLEM, Message.WAITING, Message.NONE
CONDITIONS: dict[Situation, Row] = {
    # situation: phase, then (True?, reason, message) for Ready, Progressing, Degraded, Reconciling, Stalled
    Situation.INVALID_SPEC: _row(
        Phase.FAILED,
        (False, Reason.INVALID_SPEC, _P),
        (False, Reason.INVALID_SPEC, Message.NOTHING_CREATED),
        (True, Reason.INVALID_SPEC, _P),
        (False, Reason.INVALID_SPEC, _N),
        (True, Reason.INVALID_SPEC, _P),
    ),
    Situation.APPLY_FAILED: _row(
        Phase.DEGRADED,
        (False, Reason.APPLY_FAILED, _P),
        (False, Reason.APPLY_FAILED, _P),
        (True, Reason.APPLY_FAILED, _P),
        (False, Reason.APPLY_FAILED, _N),
        (True, Reason.APPLY_FAILED, _P),
    ),
    Situation.UNSCHEDULABLE: _row(
        Phase.DEGRADED,
        (False, Reason.INSUFFICIENT_CAPACITY, _P),
        (True, Reason.PODS_NOT_READY, _W),
        (True, Reason.INSUFFICIENT_CAPACITY, _P),
        (True, Reason.PODS_NOT_READY, _W),
        (True, Reason.INSUFFICIENT_CAPACITY, _P),
    ),
    Situation.TUNING: _row(
        Phase.PROGRESSING,
        (False, Reason.TUNING, _W),
        (True, Reason.TUNING, _W),
        (False, Reason.AS_EXPECTED, _N),
        (True, Reason.TUNING, _W),
        (False, Reason.AS_EXPECTED, _N),
    ),
    Situation.PROGRESSING: _row(
        Phase.PROGRESSING,
        (False, Reason.PODS_NOT_READY, _W),
        (True, Reason.PODS_NOT_READY, _W),
        (False, Reason.AS_EXPECTED, _N),
        (True, Reason.PODS_NOT_READY, _W),
        (False, Reason.AS_EXPECTED, _N),
    ),
    Situation.READY: _row(
        Phase.READY,
        (True, Reason.ALL_READY, Message.SUMMARY),
        (False, Reason.AS_EXPECTED, _N),
        (False, Reason.AS_EXPECTED, _N),
        (False, Reason.AS_EXPECTED, _N),
        (False, Reason.AS_EXPECTED, _N),
    ),
}


def conditions_table_markdown() -> str:
    """The table of docs/api.md, printed from ``CONDITIONS`` (a test keeps them equal)."""
    lines = ["| situation | phase | conditions that are True (reason) |", "|---|---|---|"]
    for situation, row in CONDITIONS.items():
        by_reason: dict[str, list[str]] = {}
        for c in row.conditions:
            if c.true:
                by_reason.setdefault(c.reason.value, []).append(c.type)
        true = "; ".join(f"{', '.join(types)} ({reason})" for reason, types in by_reason.items())
        lines.append(f"| {situation.value} | {row.phase.value} | {true} |")
    return "\n".join(lines)


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str | None = None
    last_transition_time: str | None = None
    observed_generation: int | None = None


class StageStatus(Model):
    desired: int = 0
    ready: int = 0


class StagesStatus(Model):
    """Desired and ready pods per rendered stage (encode/prefill/decode, or omni)."""

    encode: StageStatus | None = None
    prefill: StageStatus | None = None
    decode: StageStatus | None = None
    omni: StageStatus | None = Field(default=None, description="omni-colocated mode: one pod per GPU.")


class EffectiveConfig(Model):
    """The (allocation, B, s, SM partition) actually deployed, and where each value came from."""

    allocation: Allocation
    allocation_label: str = Field(description="Compact E/P/D label, e.g. 2E-1P(tp2)-2D(tp2).")
    batch_bound: int
    offload_ratio: float
    sm_partition: str | None = Field(default=None, description="SM partition mode in force.")
    source: Literal["spec", "tuning"] = Field(
        default="spec", description="tuning when any value below came from the HAS search."
    )
    sources: dict[str, Literal["spec", "tuned", "adapted", "default"]] = Field(
        default_factory=dict,
        description="Per searched field (allocation, encode.batchBound, offload.ratio, smPartition.mode): "
        "spec (written in the manifest), tuned (status.tuning's result fills the unset field), adapted "
        "(the autopilot's live value, status.adapt) or default.",
    )


# ------------------------------------------------------------------------------------ tuning
class TuningState(StrEnum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class TuningPhase(StrEnum):
    """Where a search is: Profiling, Tuning (trials), Deploying (tuned values roll out), Ready, Failed."""

    PROFILING = "Profiling"
    TUNING = "Tuning"
    DEPLOYING = "Deploying"
    READY = "Ready"
    FAILED = "Failed"


class TrialMetricsStatus(Model):
    """What one trial measured (seconds; goodput in req/s per SLO tier)."""

    throughput: float
    ttft_mean: float
    tpot_mean: float
    goodput: dict[str, float] = Field(default_factory=dict)
    ttft_p99: float | None = None
    tpot_p99: float | None = None
    completed: int = 0
    cost_s: float = 0.0


class AllocCounts(Model):
    encode: int
    prefill: int
    prefill_tp: int
    decode: int
    decode_tp: int


class TuningBest(Model):
    """The recommendation: copy specAllocation, batchBound and offloadRatio into Git."""

    allocation: str = Field(description="E/P/D label of the recommended allocation.")
    alloc: AllocCounts
    batch_bound: int
    offload_ratio: float
    trial: int
    value: float
    metrics: TrialMetricsStatus
    spec_allocation: Allocation = Field(description="spec.allocation that runs the recommendation.")


class Stage1Row(Model):
    allocation: str
    score: float | None = None
    bottleneck: str | None = None
    kept: bool
    reason: str | None = None


class Stage1Summary(Model):
    kept: int
    of: int
    table: list[Stage1Row] = Field(default_factory=list)


class TuningStatus(Model):
    """Progress and result of the HAS search that spec.tuning.enabled runs in the operator."""

    state: TuningState
    fingerprint: str = Field(description="The search's inputs: the spec without allocation, B, s and SM split.")
    partition: str | None = Field(default=None, description="SM partition the search's s < 1 trials ran with.")
    started_at: str | None = None
    finished_at: str | None = None
    trials: int | None = Field(default=None, description="Trials run so far (resumed ones included).")
    resumed_trials: int | None = Field(default=None, description="Trials recovered from records after a restart.")
    budget: int | None = None
    best_so_far: float | None = None
    message: str | None = None
    method: str | None = None
    objective: str | None = None
    rate: float | None = None
    best: TuningBest | None = None
    stop_reason: str | None = None
    n_trials: int | None = None
    stage1: Stage1Summary | None = None
    device_s: float | None = None
    trials_on: str | None = Field(
        default=None, description="Where the trials ran: twin (predicted) or cluster (measured, scored from Prometheus)."
    )
    prometheus_url: str | None = Field(default=None, description="The Prometheus that scored cluster trials.")
    phase: TuningPhase | None = Field(default=None, description="Profiling, Tuning, Deploying, Ready or Failed.")
    stage1_sources: dict[str, str] | None = Field(
        default=None,
        description="Where each stage's Stage-1 capacity came from: job (a profiling Job on this cluster), "
        "recovered (its report, after an operator restart) or twin (the engine cannot be profiled there).",
    )
    current_trial: str | None = Field(
        default=None, description="The trial running now: its number and candidate, e.g. 3: 2E-1P(tp2)-2D(tp2) B=8 s=0.5."
    )
    eta_seconds: float | None = Field(
        default=None, description="Upper bound on the search's remaining time: the mean trial so far times the budget left."
    )
    applies: list[str] | None = Field(
        default=None, description="Fields the search's result fills in (unset in the spec); empty: a recommendation only."
    )
    trials_detail: list[dict[str, Any]] | None = Field(
        default=None,
        description="Per trial: its candidate, metrics and where they came from (prometheus, with the load "
        "Job's own report beside them, or twin).",
    )


class AdaptKnobs(Model):
    batch_bound: int
    offload_ratio: float


class AdaptDecisionStatus(Model):
    """One autopilot change: when, why, from what to what, and what the twin expects of it."""

    at: str = Field(description="When it was applied (UTC).")
    kind: Literal["retune", "rollback"]
    observed_rate: float = Field(description="Arrival rate that triggered it (req/s, model time).")
    reference_rate: float = Field(description="The rate the knobs in force before it were tuned for.")
    old: AdaptKnobs
    new: AdaptKnobs
    predicted_goodput: float | None = Field(default=None, description="The twin's goodput for the new knobs.")
    reason: str
    recommended_allocation: str | None = Field(
        default=None, description="An allocation the twin expects to do better (recommended, or applied: newAllocation)."
    )
    old_allocation: str | None = Field(default=None, description="Allocation before an applied allocation change.")
    new_allocation: str | None = Field(
        default=None, description="Allocation this change rolled the deployment to (allowAllocationChanges)."
    )


class AdaptRetuneStatus(Model):
    """One re-tune the band triggered, applied or not: a load step that moved no knob (the knobs in
    force were already the re-tuner's best for the new rate) shows here and not in ``decisions``."""

    at: str = Field(description="When it ran (UTC).")
    observed_rate: float = Field(description="The rate it re-tuned for (req/s, model time).")
    reference_rate: float = Field(description="The rate the knobs before it were chosen for.")
    direction: Literal["above", "below"] = Field(description="Which side of the band the rate had left.")
    answer: AdaptKnobs = Field(description="The knobs in force after it (pinned knobs kept).")
    predicted_goodput: float = Field(description="The twin's goodput for the answer at the rate (band headroom in).")
    applied: bool = Field(description="False: the answer was the knobs already in force; nothing changed.")


class AdaptCalibration(Model):
    """The twin's stage-cost multipliers the autopilot re-tunes with, from what the deployment measured."""

    encode: float = Field(description="Measured / profile time of the encode micro-batches run (same items and SM shares).")
    prefill: float = Field(description="Prefill multiplier (1: no live signal of its own; the profile's cost).")
    decode: float = Field(description="Measured / predicted mean TPOT at the knobs and rate in force.")
    at: str | None = Field(default=None, description="When it was last computed (at a re-tune).")
    measured: dict[str, float] = Field(
        default_factory=dict,
        description="The live figures it came from (encodeBatchSeconds, encodeProfileSeconds, encodeItemsPerBatch, "
        "encodeShare, tpotSeconds, predictedTpotSeconds; per micro-batch or request, real time).",
    )


class AdaptStatus(Model):
    """The autopilot (``spec.tuning.adapt``): the live knobs it keeps in force and what it changed."""

    knobs: AdaptKnobs = Field(description="B and s in force (fill spec.encode.batchBound / spec.offload.ratio when unset).")
    reference_rate: float = Field(description="The rate the knobs in force were chosen for (req/s).")
    observed_rate: float | None = Field(default=None, description="Latest arrival rate read from Prometheus (req/s).")
    good_fraction: float | None = Field(default=None, description="Latest goodput / arrival rate at the objective tier.")
    observed_at: str | None = None
    pinned: list[str] = Field(default_factory=list, description="Knobs the spec writes explicitly (never moved).")
    allocation: Allocation | None = Field(
        default=None,
        description="The allocation the autopilot applied (allowAllocationChanges; fills spec.allocation when unset). "
        "None: the tuned or written one runs.",
    )
    allocation_label: str | None = None
    decisions: list[AdaptDecisionStatus] = Field(default_factory=list, description="Changes, newest last (20 kept).")
    retunes: list[AdaptRetuneStatus] = Field(
        default_factory=list, description="Re-tunes, applied or not, newest last (10 kept)."
    )
    calibration: AdaptCalibration | None = Field(
        default=None, description="The live calibration of the twin used by the last re-tune (docs/adapt.md)."
    )
    message: str | None = None


class EPDDeploymentStatus(Model):
    observed_generation: int | None = None
    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    stages: StagesStatus | None = None
    effective: EffectiveConfig | None = None
    ready_summary: str | None = Field(default=None, description="Ready pods per stage, e.g. 2/2,1/1,2/2.")
    config_hash: str | None = Field(default=None, description="Checksum of the runtime ConfigMap in force.")
    tuning: TuningStatus | None = Field(default=None, description="Progress and result of the HAS search.")
    adapt: AdaptStatus | None = Field(default=None, description="The autopilot's live knobs and changes.")
