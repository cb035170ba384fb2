"""The trial loop shared by HAS Stage 2 and the baselines: ask, run, record, stop.

Every method is a ``Proposer`` (ask for the next candidate, be told its result). This one loop
runs the trial, appends the JSON record, applies the stop rules and keeps the wall clock, so
HAS, Random and Coordinate are compared under exactly the same budget, stop rules, caching and
selection rule: only the proposer differs.

Stop rules (paper §3.1, issue 5), checked before each new trial, first one wins:

- ``converged``: the spread among the top three results, (v1 − v3) / v1, is under 1%, once the
  proposer has run at least three trials of its own beyond the seeds it was given (HAS's Stage-1
  seeds, one per surviving allocation). Seeds alone tie easily: Stage 1 ranks allocations by
  capacity, so at a load every seed carries they all score about the offered rate. On the twin at
  Λ = 3 (LLaVA example, 100-request trials) the first three of six seeds scored within 0.2 % and
  the search stopped there, before it had tried half the survivors; the fifth seed (a TP-4 decode,
  which drains sooner) scores 10 % more. The cluster, whose trials differ by more than 1 %, went
  on and found it, so the two backends picked differently (issue 13);
- ``stalled``: 5 consecutive trials brought no improvement of the best value;
- ``budget``: the trial budget (default 30) is spent.

A proposal that repeats an already measured point is answered from memory (a ``cached``
record: no device time, not counted by the rules), because re-deploying an identical
configuration teaches nothing; ``exhausted`` stops a proposer that only repeats itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from easerve_operator.tuning.records import RecordMismatch, RecordStore, TrialRecord
from easerve_operator.tuning.runners import TrialMetrics
from easerve_operator.tuning.selection import DEFAULT_TIE_TOLERANCE, Objective, select_best
from easerve_operator.tuning.space import Candidate

DEFAULT_BUDGET = 30
DEFAULT_PATIENCE = 5
DEFAULT_SPREAD = 0.01
DEFAULT_MIN_REFINED = 3
MAX_CACHED_IN_A_ROW = 50


@dataclass(frozen=True)
class Proposal:
    candidate: Candidate
    seeded: bool = False


class Proposer(Protocol):
    """A search method. ``ask`` returns ``None`` when it has nothing left to propose."""

    method: str

    def ask(self) -> Proposal | None: ...

    def tell(self, record: TrialRecord) -> None: ...

    def restore(self, records: Sequence[TrialRecord]) -> None:
        """Bring the proposer to the state it had after ``records`` (resume)."""
        ...


@dataclass(frozen=True)
class StopRules:
    budget: int = DEFAULT_BUDGET
    patience: int = DEFAULT_PATIENCE
    spread: float = DEFAULT_SPREAD
    max_cached_in_a_row: int = MAX_CACHED_IN_A_ROW
    min_refined: int = DEFAULT_MIN_REFINED
    """Real trials beyond the seeds that ``converged`` needs (the top-three statistic's size)."""

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not 0 <= self.spread < 1:
            raise ValueError(f"spread must be in [0, 1), got {self.spread}")
        if self.min_refined < 0:
            raise ValueError(f"min_refined must be >= 0, got {self.min_refined}")

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "patience": self.patience, "spread": self.spread, "minRefined": self.min_refined}


def stop_reason(
    values: Sequence[float | None], rules: StopRules, seeded: Sequence[bool] | None = None
) -> str | None:
    """Which rule stops a search whose real (non-cached) trials scored ``values``, in order.

    ``None`` entries are failed trials: they spend budget and count as "no improvement".
    ``seeded`` flags the trials that were seeds handed to the proposer (none when omitted).
    """
    if seeded is not None and len(seeded) != len(values):
        raise ValueError(f"seeded: {len(seeded)} flags for {len(values)} values")
    refined = len(values) - (sum(seeded) if seeded is not None else 0)
    ok = sorted((v for v in values if v is not None), reverse=True)
    if refined >= rules.min_refined and len(ok) >= 3 and ok[0] > 0 and (ok[0] - ok[2]) / ok[0] < rules.spread:
        return "converged"
    best: float | None = None
    since = 0
    for v in values:
        if v is not None and (best is None or v > best):
            best, since = v, 0
        else:
            since += 1
    if values and since >= rules.patience:
        return "stalled"
    if len(values) >= rules.budget:
        return "budget"
    return None


def baseline_first(record: TrialRecord) -> bool:
    """The trial a tie goes to (``selection.select_best``'s ``prefer``): the baseline configuration
    (``Candidate.is_baseline``). The tuner's pick and anything that re-ranks its trials (the GPU
    plans of ``benchmarks/has_hardware.py``) read this one rule."""
    return record.candidate.is_baseline()


@dataclass
class SearchOutcome:
    method: str
    records: list[TrialRecord]
    stop: str
    wall_s: float
    objective: Objective
    rel_tol: float = DEFAULT_TIE_TOLERANCE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def real(self) -> list[TrialRecord]:
        return [r for r in self.records if not r.cached]

    def best(self) -> TrialRecord | None:
        """The winner under the lexicographic rule among successful real trials (a tie goes to
        the baseline configuration, ``Candidate.is_baseline``)."""
        ok = [r for r in self.real if r.ok]

        def metrics(r: TrialRecord) -> TrialMetrics:
            assert r.metrics is not None
            return r.metrics

        return select_best(ok, metrics, self.objective, self.rel_tol, prefer=baseline_first)


def run_search(
    proposer: Proposer,
    evaluate: Callable[[Candidate], TrialMetrics],
    objective: Objective,
    rules: StopRules,
    *,
    store: RecordStore | None = None,
    prior: Sequence[TrialRecord] = (),
    clock: Callable[[], float] = time.perf_counter,
    on_trial: Callable[[TrialRecord, list[TrialRecord]], None] | None = None,
    rel_tol: float = DEFAULT_TIE_TOLERANCE,
) -> SearchOutcome:
    """Run ``proposer`` until a stop rule fires; ``prior`` records resume a killed search.

    ``evaluate`` runs one trial (it may raise: the trial is recorded as failed). Each record is
    appended to ``store`` before the next trial starts. ``clock`` is injected so tests can make
    wall times deterministic.
    """
    records = list(prior)
    if prior:
        proposer.restore(records)
    seen: dict[tuple[Any, ...], TrialRecord] = {}
    for r in records:
        if not r.cached:
            seen.setdefault(r.candidate.key(), r)
    t_start = clock()
    cached_run = 0
    stop: str | None = None
    while True:
        real = [r for r in records if not r.cached]
        stop = stop_reason([r.value if r.ok else None for r in real], rules, [r.seeded for r in real])
        if stop is not None:
            break
        if cached_run >= rules.max_cached_in_a_row:
            stop = "exhausted"
            break
        prop = proposer.ask()
        if prop is None:
            stop = "exhausted"
            break
        cand = prop.candidate
        number = len(records)
        hit = seen.get(cand.key())
        if hit is not None:
            rec = TrialRecord(
                number,
                proposer.method,
                cand,
                hit.state,
                hit.metrics,
                hit.value,
                cached=True,
                seeded=prop.seeded,
                error=hit.error,
                wall_s=0.0,
            )
            cached_run += 1
        else:
            cached_run = 0
            t0 = clock()
            try:
                m = evaluate(cand)
                value = objective.value(m)
                rec = TrialRecord(
                    number,
                    proposer.method,
                    cand,
                    "complete",
                    m,
                    value,
                    seeded=prop.seeded,
                    wall_s=clock() - t0,
                )
            except Exception as exc:  # a trial that cannot run is a result, not a crash
                rec = TrialRecord(
                    number,
                    proposer.method,
                    cand,
                    "failed",
                    None,
                    None,
                    seeded=prop.seeded,
                    error=f"{type(exc).__name__}: {exc}",
                    wall_s=clock() - t0,
                )
            seen[cand.key()] = rec
        if store is not None:
            store.append(rec)
        records.append(rec)
        proposer.tell(rec)
        if on_trial is not None:
            on_trial(rec, records)
    return SearchOutcome(proposer.method, records, stop, clock() - t_start, objective, rel_tol)


def replay(proposer: Proposer, records: Sequence[TrialRecord]) -> None:
    """Generic ``restore``: re-ask the proposer and feed it the recorded results.

    Works for any proposer whose proposals are a pure function of its seed and history; a
    mismatch means the records came from a different search and is an error, never ignored.
    """
    for r in records:
        p = proposer.ask()
        if p is None or p.candidate.key() != r.candidate.key():
            got = None if p is None else p.candidate.to_dict()
            raise RecordMismatch(
                f"records do not replay: trial {r.number} was {r.candidate.to_dict()}, proposer gave {got}"
            )
        proposer.tell(r)
