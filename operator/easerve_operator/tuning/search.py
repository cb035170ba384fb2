"""``tune``: one HAS (or baseline) search end to end, and its ``TuningResult``.

This is the function the CLI, the benchmark and (later) the operator call. It wires the parts
together: the space from the spec and the profile, Stage 1 through a ``Profiler``, a proposer
(HAS Stage 2, Random or Coordinate), trials through a ``TrialRunner``, JSON records through a
``RecordStore`` (resume after a kill), and lexicographic selection. ``TuningResult`` is what
goes into ``status.tuning`` or a report file (``to_dict`` is JSON-ready).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec

from easerve_operator.tuning.loop import Proposer, SearchOutcome, StopRules, run_search
from easerve_operator.tuning.records import RecordStore, TrialRecord, spec_digest
from easerve_operator.tuning.runners import Profiler, TrialMetrics, TrialRunner
from easerve_operator.tuning.selection import DEFAULT_TIE_TOLERANCE, Objective
from easerve_operator.tuning.space import Candidate, SearchSpace, apply_candidate
from easerve_operator.tuning.stage1 import Stage1Result, run_stage1

METHODS = ("has", "random", "coordinate")


@dataclass(frozen=True)
class BestConfig:
    """The chosen (allocation, B, s), its metrics, and the full spec that runs it."""

    candidate: Candidate
    metrics: TrialMetrics
    value: float
    trial: int
    spec: EPDDeploymentSpec

    @property
    def allocation(self) -> str:
        return self.candidate.alloc.label

    @property
    def batch_bound(self) -> int:
        return self.candidate.batch_bound

    @property
    def offload_ratio(self) -> float:
        return self.candidate.offload_ratio

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
            "trial": self.trial,
            "value": self.value,
            "metrics": self.metrics.to_dict(),
            "spec_allocation": self.spec.allocation.wire(),
        }


@dataclass
class TuningResult:
    method: str
    objective: str
    rate: float
    seed: int
    requests: int
    space: SearchSpace
    rules: StopRules
    stage1: Stage1Result | None
    trials: list[TrialRecord]
    stop_reason: str
    best: BestConfig | None
    search_wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stage1_table(self) -> list[dict[str, Any]]:
        return [] if self.stage1 is None else [r.to_dict() for r in self.stage1.rows]

    @property
    def real_trials(self) -> list[TrialRecord]:
        return [t for t in self.trials if not t.cached]

    def convergence(self) -> list[dict[str, Any]]:
        """Best objective value after each real trial, with cumulative wall and device time."""
        out: list[dict[str, Any]] = []
        best: float | None = None
        wall = 0.0
        dev = 0.0 if self.stage1 is None else self.stage1.capacities.parallel_cost_s
        for k, t in enumerate(self.real_trials, start=1):
            wall += t.wall_s
            dev += t.cost_s
            if t.ok and t.value is not None and (best is None or t.value > best):
                best = t.value
            out.append({"trial": k, "value": t.value, "best": best, "wall_s": wall, "device_s": dev})
        return out

    def summary(self) -> dict[str, Any]:
        """The compact form for ``status.tuning``: the choice, why, and what it cost (no trial list)."""
        dev = sum(t.cost_s for t in self.real_trials)
        if self.stage1 is not None:
            dev += self.stage1.capacities.parallel_cost_s
        return {
            "method": self.method,
            "objective": self.objective,
            "rate": self.rate,
            "best": None if self.best is None else self.best.to_dict(),
            "stop_reason": self.stop_reason,
            "n_trials": len(self.real_trials),
            "stage1": None
            if self.stage1 is None
            else {
                "kept": len(self.stage1.seeds),
                "of": len(self.stage1.rows),
                "table": [
                    {k: r[k] for k in ("allocation", "score", "bottleneck", "kept", "reason")}
                    for r in self.stage1_table
                ],
            },
            "device_s": dev,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "objective": self.objective,
            "rate": self.rate,
            "seed": self.seed,
            "requests_per_trial": self.requests,
            "space": self.space.to_dict(),
            "rules": self.rules.to_dict(),
            "stop_reason": self.stop_reason,
            "n_trials": len(self.real_trials),
            "n_cached": len(self.trials) - len(self.real_trials),
            "best": None if self.best is None else self.best.to_dict(),
            "stage1": None if self.stage1 is None else self.stage1.to_dict(),
            "stage1_table": self.stage1_table,
            "trials": [t.to_dict() for t in self.trials],
            "convergence": self.convergence(),
            "search_wall_s": self.search_wall_s,
            **self.extra,
        }


def make_proposer(
    method: str, space: SearchSpace, seed: int, stage1: Stage1Result | None, **kw: Any
) -> Proposer:
    if method == "has":
        from easerve_operator.tuning.stage2 import HASProposer  # optuna: imported only when used

        assert stage1 is not None
        return HASProposer(stage1, space, seed, **kw)
    from easerve_operator.tuning.baselines import CoordinateProposer, RandomProposer

    if method == "random":
        return RandomProposer(space, seed)
    if method == "coordinate":
        return CoordinateProposer(space, seed)
    raise ValueError(f"method: expected one of {METHODS}, got '{method}'")


def tune(
    spec: EPDDeploymentSpec,
    *,
    runner: TrialRunner,
    profiler: Profiler,
    space: SearchSpace,
    rate: float,
    method: str = "has",
    objective: str = "throughput",
    rules: StopRules | None = None,
    seed: int = 0,
    workload_seed: int = 1,
    requests: int = 500,
    store: RecordStore | None = None,
    resume: bool = False,
    stage1: Stage1Result | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_trial: Callable[[TrialRecord, list[TrialRecord]], None] | None = None,
    rel_tol: float = DEFAULT_TIE_TOLERANCE,
    proposer_kw: dict[str, Any] | None = None,
) -> TuningResult:
    """Search ``space`` for ``spec`` at rate Λ = ``rate`` and return the result.

    ``stage1`` may be passed in (e.g. cached by a benchmark); otherwise HAS runs it through
    ``profiler`` (and stores it with the records, so a resume does not profile again).
    ``workload_seed`` is the same for every trial (common random numbers).
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got '{method}'")
    obj = Objective.parse(objective, [t.name for t in spec.slo.tiers])
    rules = rules or StopRules()
    prior: list[TrialRecord] = []
    if store is not None:
        header = {
            "method": method,
            "objective": str(obj),
            "rate": rate,
            "seed": seed,
            "workload_seed": workload_seed,
            "requests": requests,
            "space": space.to_dict(),
            "rules": rules.to_dict(),
            "spec": spec_digest(spec.wire()),
        }
        stored, prior = store.open(header, resume=resume)
        if stored is not None and stage1 is None:
            stage1 = Stage1Result.from_dict(stored)
    if method == "has" and stage1 is None:
        stage1 = run_stage1(profiler, space, rate, clock=clock)
        if store is not None:
            store.write_stage1(stage1.to_dict())

    def evaluate(c: Candidate) -> TrialMetrics:
        return runner.run_trial(apply_candidate(spec, c), rate, requests, workload_seed)

    proposer = make_proposer(method, space, seed, stage1 if method == "has" else None, **(proposer_kw or {}))
    out: SearchOutcome = run_search(
        proposer,
        evaluate,
        obj,
        rules,
        store=store,
        prior=prior,
        clock=clock,
        on_trial=on_trial,
        rel_tol=rel_tol,
    )
    win = out.best()
    best = None
    if win is not None:
        assert win.metrics is not None and win.value is not None
        best = BestConfig(
            win.candidate, win.metrics, win.value, win.number, apply_candidate(spec, win.candidate)
        )
    return TuningResult(
        method=method,
        objective=str(obj),
        rate=rate,
        seed=seed,
        requests=requests,
        space=space,
        rules=rules,
        stage1=stage1 if method == "has" else None,
        trials=out.records,
        stop_reason=out.stop,
        best=best,
        search_wall_s=out.wall_s,
    )
