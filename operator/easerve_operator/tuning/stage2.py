"""HAS Stage 2: one seeded Optuna TPE study over the Stage-1 survivors.

The space is mixed (categorical allocation, integer B, continuous s) and conditional (each
allocation has its own B range and s window), so the study uses per-allocation parameter names
``B[<label>]`` and ``s[<label>]`` and a multivariate, grouped TPE sampler, which models such
conditional spaces natively. Each survivor's analytical optimum is enqueued before any sampling
(``study.enqueue_trial``), so the first trials are the Stage-1 seeds.

The baseline is always tried (issue 17: "never below either baseline; HAS must fall back to
s = 1, B = 1 or the best layout when nothing else pays"). After the analytical seeds, one more
seed is enqueued: ``fallback_candidate``, the Dynamo-style configuration of the best-scored
survivor that has a remote prefill pool (B = 1: pass-through encode; s = 1: every prefill remote),
its s window widened to reach 1. A search whose refinements all score below it therefore still
picks it, by the same selection rule, instead of a configuration under the baseline. Why a seed
and not a post-hoc comparison: it is one real trial, measured like every other (on the cluster,
through Prometheus), so the pick stays the best *measured* point, and a resumed search replays it
like any other seed.

Determinism and resume: the sampler is re-created before every ask with a seed derived from
(search seed, number of trials so far). A proposal is therefore a pure function of the seed and
the history, so a search rebuilt from its JSON records (``optuna.trial.create_trial`` +
``study.add_trial``, seeds already run are not enqueued again) continues exactly as the
uninterrupted search would have. Storage is in memory; the records are the persistence.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from easerve_operator.tuning.loop import Proposal
from easerve_operator.tuning.records import TrialRecord
from easerve_operator.tuning.space import Candidate, SearchSpace, round_s
from easerve_operator.tuning.stage1 import SeedRange, Stage1Result

DEFAULT_STARTUP_TRIALS = 6

optuna.logging.set_verbosity(optuna.logging.WARNING)


def derive_seed(seed: int, n: int) -> int:
    """A per-trial sampler seed from the search seed and the trial index (stable across runs)."""
    return (seed * 1_000_003 + n * 7919 + 17) % (2**32)


def fallback_candidate(stage1: Stage1Result, space: SearchSpace) -> Candidate | None:
    """The baseline configuration Stage 2 always tries: B = 1 and s = 1 on the first survivor (in
    Stage 1's rank order) whose space admits s = 1, else B = 1 at the first survivor's seed s (the
    best layout with pass-through encode). ``None`` when that is already an analytical seed."""
    if not stage1.seeds:
        return None
    with_remote = [r for r in stage1.seeds if 1.0 in space.s_values(r.alloc)]
    r = with_remote[0] if with_remote else stage1.seeds[0]
    c = Candidate(r.alloc, 1, 1.0 if with_remote else r.s_seed)
    seeds = {Candidate(x.alloc, x.b_seed, x.s_seed).key() for x in stage1.seeds}
    return None if c.key() in seeds else c


class HASProposer:
    """Stage 2 as a ``Proposer`` for ``loop.run_search``."""

    method = "has"

    def __init__(
        self,
        stage1: Stage1Result,
        space: SearchSpace,
        seed: int,
        *,
        n_startup_trials: int = DEFAULT_STARTUP_TRIALS,
        fallback: bool = True,
    ) -> None:
        if not stage1.seeds:
            raise ValueError("Stage 1 kept no allocation: nothing for Stage 2 to refine")
        self.ranges: dict[str, SeedRange] = {r.alloc.label: r for r in stage1.seeds}
        self.fallback = fallback_candidate(stage1, space) if fallback else None
        if self.fallback is not None:  # its s window reaches the fallback's s
            f, r = self.fallback, self.ranges[self.fallback.alloc.label]
            self.ranges[f.alloc.label] = replace(
                r, s_lo=min(r.s_lo, f.offload_ratio), s_hi=max(r.s_hi, f.offload_ratio)
            )
        self.labels = [r.alloc.label for r in stage1.seeds]
        self.space = space
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self._trial: optuna.trial.Trial | None = None
        self.study = self._new_study(run=())

    # -- parameters -------------------------------------------------------------------------
    def _distributions(self, label: str) -> dict[str, BaseDistribution]:
        r = self.ranges[label]
        d: dict[str, BaseDistribution] = {"alloc": CategoricalDistribution(self.labels)}
        if r.b_max > 1:
            d[f"B[{label}]"] = IntDistribution(1, r.b_max)
        if r.s_hi > r.s_lo:
            d[f"s[{label}]"] = FloatDistribution(r.s_lo, r.s_hi, step=self.space.s_step)
        return d

    def params_of(self, c: Candidate) -> dict[str, Any]:
        """Optuna params of a candidate; raises if it lies outside the survivors' ranges."""
        label = c.alloc.label
        r = self.ranges.get(label)
        if r is None:
            raise ValueError(f"candidate {label} is not a Stage-1 survivor {self.labels}")
        if not 1 <= c.batch_bound <= r.b_max or not r.s_lo - 1e-9 <= c.offload_ratio <= r.s_hi + 1e-9:
            raise ValueError(f"candidate {c.to_dict()} is outside the range of {label}: {r.to_dict()}")
        p: dict[str, Any] = {"alloc": label}
        if r.b_max > 1:
            p[f"B[{label}]"] = c.batch_bound
        if r.s_hi > r.s_lo:
            p[f"s[{label}]"] = round_s(c.offload_ratio)
        return p

    def seed_candidates(self) -> list[Candidate]:
        """The enqueued trials, in order: each survivor's analytical optimum, then the fallback."""
        seeds = [Candidate(r.alloc, r.b_seed, r.s_seed) for r in self.ranges.values()]
        return seeds if self.fallback is None else [*seeds, self.fallback]

    # -- study ------------------------------------------------------------------------------
    def _sampler(self, n: int) -> optuna.samplers.TPESampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=derive_seed(self.seed, n),
                n_startup_trials=self.n_startup_trials,
                multivariate=True,
                group=True,
            )

    def _new_study(self, run: Sequence[Candidate]) -> optuna.Study:
        """A study with every seed not among ``run`` enqueued, in seed order.

        Which seeds ran is read from the candidates, not their count: a search recorded by an
        operator without the fallback seed and resumed by one with it (an upgrade mid-search) runs
        the fallback next rather than taking an old TPE trial for it."""
        study = optuna.create_study(direction="maximize", sampler=self._sampler(0))
        done = {c.key() for c in run}
        todo = [c for c in self.seed_candidates() if c.key() not in done]
        for c in todo:
            study.enqueue_trial(self.params_of(c))
        return study

    def ask(self) -> Proposal:
        trials = self.study.get_trials(deepcopy=False)
        n = len([t for t in trials if t.state != TrialState.WAITING])
        # Optuna hands out enqueued (WAITING) trials first: this ask is a seed while any remain
        seeded = n < len(trials)
        self.study.sampler = self._sampler(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            t = self.study.ask()
            label = t.suggest_categorical("alloc", self.labels)
            r = self.ranges[str(label)]
            b = t.suggest_int(f"B[{label}]", 1, r.b_max) if r.b_max > 1 else 1
            s = (
                t.suggest_float(f"s[{label}]", r.s_lo, r.s_hi, step=self.space.s_step)
                if r.s_hi > r.s_lo
                else r.s_lo
            )
        self._trial = t
        return Proposal(Candidate(r.alloc, int(b), round_s(s)), seeded=seeded)

    def tell(self, record: TrialRecord) -> None:
        assert self._trial is not None, "tell() without ask()"
        if record.ok:
            self.study.tell(self._trial, record.value)
        else:
            self.study.tell(self._trial, state=TrialState.FAIL)
        self._trial = None

    def restore(self, records: Sequence[TrialRecord]) -> None:
        """Rebuild the study from records: ``create_trial`` + ``add_trial``, then the seeds not yet run."""
        self.study = self._new_study(run=[rec.candidate for rec in records])
        for rec in records:
            params = self.params_of(rec.candidate)
            dists = self._distributions(rec.candidate.alloc.label)
            if rec.ok:
                ft = optuna.trial.create_trial(params=params, distributions=dists, value=rec.value)
            else:
                ft = optuna.trial.create_trial(params=params, distributions=dists, state=TrialState.FAIL)
            self.study.add_trial(ft)
