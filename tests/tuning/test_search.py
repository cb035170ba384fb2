"""Whole searches over the test doubles: determinism, resume after a kill, failures, baselines."""

from __future__ import annotations

import json

import pytest
from easerve_operator.tuning.loop import StopRules
from easerve_operator.tuning.records import RecordMismatch, RecordStore
from easerve_operator.tuning.search import tune
from easerve_operator.tuning.space import space_for


class Killed(BaseException):
    """Stands in for SIGKILL: escapes the loop's per-trial error handling."""


class KillAfter:
    def __init__(self, inner, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    def run_trial(self, spec, rate, requests, seed):
        if self.calls >= self.n:
            raise Killed()
        self.calls += 1
        return self.inner.run_trial(spec, rate, requests, seed)


def run(spec, td, method="has", seed=3, store=None, resume=False, runner=None, budget=30, **kw):
    space = space_for(spec, 2, max_batch=8, s_step=0.1)
    return tune(
        spec,
        runner=runner or td.AnalyticTestRunner(),
        profiler=td.TableTestProfiler(),
        space=space,
        rate=5.0,
        method=method,
        seed=seed,
        requests=100,
        rules=StopRules(budget=budget),
        store=store,
        resume=resume,
        clock=td.FakeClock(),
        **kw,
    )


def keys(res):
    return [(t.candidate.key(), t.value, t.cached) for t in res.trials]


@pytest.mark.parametrize("method", ["has", "random", "coordinate"])
def test_seeded_search_is_deterministic(image_spec, td, method):
    a, b = run(image_spec, td, method), run(image_spec, td, method)
    assert keys(a) == keys(b) and a.stop_reason == b.stop_reason
    assert a.to_dict() == b.to_dict()


def test_has_runs_seeds_first_and_only_survivors(image_spec, td):
    runner = td.AnalyticTestRunner()
    res = run(image_spec, td, runner=runner)
    seeds = [(s.alloc, s.b_seed, s.s_seed) for s in res.stage1.seeds]
    assert [t.candidate.key() for t in res.trials[: len(seeds)]] == seeds
    assert all(t.seeded for t in res.trials[: len(seeds)])
    survivors = set(res.stage1.survivors)
    assert all(t.candidate.alloc in survivors for t in res.trials)
    # every real trial ran exactly once on the runner; cached ones did not run again
    real = [t for t in res.trials if not t.cached]
    assert len(runner.log) == len(real) == len({t.candidate.key() for t in real})
    assert res.stop_reason in {"converged", "stalled", "budget", "exhausted"}
    assert res.best is not None and res.best.value == max(t.value for t in real)
    assert res.best.spec.allocation.label() == res.best.allocation


def test_has_tries_the_baseline_right_after_the_seeds(image_spec, td):
    """Issue 17: "never below either baseline". The trial after the analytical seeds is the
    Dynamo-style configuration (B = 1, s = 1) of the best-ranked survivor with a remote prefill
    pool, flagged as a seed (it does not count toward the refinements the stop rules want)."""
    res = run(image_spec, td)
    n = len(res.stage1.seeds)
    first_remote = next(s.alloc for s in res.stage1.seeds if s.alloc.prefill > 0)
    fb = res.trials[n]
    assert (fb.candidate.alloc, fb.candidate.batch_bound, fb.candidate.offload_ratio) == (first_remote, 1, 1.0)
    assert fb.seeded and not res.trials[n + 1].seeded
    assert (first_remote, 1, 1.0) not in [(s.alloc, s.b_seed, s.s_seed) for s in res.stage1.seeds]
    # without it, Stage 2 starts sampling right after the analytical seeds
    off = run(image_spec, td, proposer_kw={"fallback": False})
    assert not off.trials[n].seeded


class OnlyTheBaselinePays:
    """The analytic double, except that every configuration but pass-through encode with all
    prefill remote (B = 1, s = 1) serves at a tenth of its goodput: nothing HAS refines pays."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def run_trial(self, spec, rate, requests, seed):
        m = self.inner.run_trial(spec, rate, requests, seed)
        if spec.encode.batch_bound == 1 and spec.offload.ratio == 1.0:
            return m
        return type(m)(m.throughput / 10, m.ttft_mean, m.tpot_mean,
                       {k: v / 10 for k, v in m.goodput.items()}, completed=m.completed, cost_s=m.cost_s)


def test_has_falls_back_to_the_baseline_when_nothing_else_pays(image_spec, td):
    res = run(image_spec, td, runner=OnlyTheBaselinePays(td.AnalyticTestRunner()), objective="goodput@moderate")
    assert res.best is not None
    assert (res.best.batch_bound, res.best.offload_ratio) == (1, 1.0)
    assert res.best.value == max(t.value for t in res.real_trials if t.value is not None)


@pytest.mark.parametrize("where", ["midway", "before-fallback", "after-fallback"])
def test_resume_after_kill_repeats_nothing_and_loses_nothing(image_spec, td, tmp_path, where):
    full = run(image_spec, td, method="has", budget=12, store=RecordStore(tmp_path / "full"))
    n_real = len(full.real_trials)
    assert n_real >= 6, "the uninterrupted search should be long enough to kill midway"
    n_seeds = len(full.stage1.seeds)  # the fallback is the trial after them
    k = {"midway": n_real // 2, "before-fallback": n_seeds, "after-fallback": n_seeds + 1}[where]
    store = RecordStore(tmp_path / "killed")
    with pytest.raises(Killed):
        run(image_spec, td, budget=12, store=store, runner=KillAfter(td.AnalyticTestRunner(), k))
    _, _, before = store.load()
    assert len([t for t in before if not t.cached]) == k
    # a torn line from the kill must be dropped, not parsed
    with store.path.open("a") as f:
        f.write('{"kind": "trial", "numb')
    runner = td.AnalyticTestRunner()
    resumed = run(
        image_spec, td, budget=12, store=RecordStore(tmp_path / "killed"), resume=True, runner=runner
    )
    # nothing lost: the records before the kill are the resumed search's prefix, unchanged
    assert [t.to_dict() for t in resumed.trials[: len(before)]] == [t.to_dict() for t in before]
    # nothing repeated: no measured point runs twice, and the runner never re-ran a recorded one
    real_keys = [t.candidate.key() for t in resumed.trials if not t.cached]
    assert len(real_keys) == len(set(real_keys))
    before_keys = {
        (t.candidate.alloc.label, t.candidate.batch_bound, t.candidate.offload_ratio) for t in before
    }
    assert not before_keys & set(runner.log)
    # and it ends exactly where the uninterrupted search ends
    assert keys(resumed) == keys(full)
    assert [t["number"] for t in map(json.loads, store.path.read_text().splitlines()[2:])] == list(
        range(len(full.trials))
    )


def test_a_search_recorded_without_the_fallback_runs_it_when_resumed(image_spec, td, tmp_path):
    """An operator upgraded mid-search: the records were written by a proposer without the fallback
    seed (two TPE trials past the analytical seeds), the resumed one has it. The fallback runs next,
    flagged as a seed, rather than one of the old TPE trials being taken for it."""
    n_seeds = len(run(image_spec, td, budget=12).stage1.seeds)
    store = RecordStore(tmp_path / "upgraded")
    with pytest.raises(Killed):
        run(image_spec, td, budget=12, store=store, runner=KillAfter(td.AnalyticTestRunner(), n_seeds + 2),
            proposer_kw={"fallback": False})
    _, _, before = store.load()
    assert [t.seeded for t in before] == [True] * n_seeds + [False, False]
    runner = td.AnalyticTestRunner()
    resumed = run(image_spec, td, budget=12, store=RecordStore(tmp_path / "upgraded"), resume=True, runner=runner)
    assert [t.to_dict() for t in resumed.trials[: len(before)]] == [t.to_dict() for t in before]
    fb = resumed.trials[len(before)]
    first_remote = next(s.alloc for s in resumed.stage1.seeds if s.alloc.prefill > 0)
    assert (fb.candidate.alloc, fb.candidate.batch_bound, fb.candidate.offload_ratio) == (first_remote, 1, 1.0)
    assert fb.seeded and not fb.cached
    assert sum(t.seeded for t in resumed.trials) == n_seeds + 1
    before_keys = {(t.candidate.alloc.label, t.candidate.batch_bound, t.candidate.offload_ratio) for t in before}
    assert not before_keys & set(runner.log)


@pytest.mark.parametrize("method", ["random", "coordinate"])
def test_baselines_resume_by_replay(image_spec, td, tmp_path, method):
    full = run(image_spec, td, method=method, budget=10)
    store = RecordStore(tmp_path / method)
    with pytest.raises(Killed):
        run(
            image_spec,
            td,
            method=method,
            budget=10,
            store=store,
            runner=KillAfter(td.AnalyticTestRunner(), 4),
        )
    resumed = run(image_spec, td, method=method, budget=10, store=RecordStore(tmp_path / method), resume=True)
    assert keys(resumed) == keys(full)


def test_resume_refuses_another_search(image_spec, td, tmp_path):
    run(image_spec, td, budget=4, store=RecordStore(tmp_path))
    with pytest.raises(FileExistsError):
        run(image_spec, td, budget=4, store=RecordStore(tmp_path))
    with pytest.raises(RecordMismatch, match="seed"):
        run(image_spec, td, seed=99, budget=4, store=RecordStore(tmp_path), resume=True)


def test_failed_trials_are_recorded_not_fatal(image_spec, td):
    first = run(image_spec, td, budget=6).trials[0].candidate
    bad = {(first.alloc.label, first.batch_bound, first.offload_ratio)}
    res = run(image_spec, td, budget=6, runner=td.AnalyticTestRunner(fail_on=bad))
    assert res.trials[0].state == "failed" and "rollout failed" in res.trials[0].error
    assert res.best is not None and res.best.candidate != first


def test_random_never_repeats_and_covers_the_space(image_spec, td):
    res = run(image_spec, td, method="random", budget=30)
    real = [t.candidate.key() for t in res.real_trials]
    assert len(real) == len(set(real)) and not any(t.cached for t in res.trials)


def test_coordinate_moves_one_dimension_at_a_time(image_spec, td):
    res = run(image_spec, td, method="coordinate", budget=30)
    cands = [t.candidate for t in res.real_trials]
    start = cands[0]
    line = cands[1:5]  # the allocation line: B and s stay at the start's values
    assert all((c.batch_bound, c.offload_ratio) == (start.batch_bound, start.offload_ratio) for c in line)
    assert len({c.alloc for c in cands[:5]}) == 5


def test_goodput_objective_changes_the_ranking(image_spec, td):
    res = run(image_spec, td, objective="goodput@moderate", budget=10)
    assert res.objective == "goodput@moderate"
    assert res.best.value == res.best.metrics.goodput["moderate"]


def test_summary_is_compact_and_consistent(image_spec, td):
    res = run(image_spec, td, budget=6)
    s = res.summary()
    assert s["best"] == res.best.to_dict() and s["n_trials"] == len(res.real_trials)
    assert s["stage1"]["kept"] == len(res.stage1.seeds) and "trials" not in s
    assert s["device_s"] == pytest.approx(
        res.stage1.capacities.parallel_cost_s + sum(t.cost_s for t in res.real_trials)
    )
    json.dumps(s)


@pytest.mark.parametrize("method", ["has", "random", "coordinate"])
def test_every_proposal_is_a_valid_point_all_local_included(image_spec, td, method):
    """The space holds all-local allocations (prefill 0, s = 0); no method proposes a point the
    space or the spec refuses (a refused spec would show as a failed trial)."""
    space = space_for(image_spec, 2, max_batch=8, s_step=0.1)
    res = run(image_spec, td, method, budget=30)
    assert res.real_trials and not [t.error for t in res.trials if t.state == "failed"]
    assert all(space.contains(t.candidate) for t in res.real_trials)
    all_local = [t.candidate for t in res.real_trials if t.candidate.alloc.prefill == 0]
    assert all(c.offload_ratio == 0.0 for c in all_local)
    if method == "coordinate":  # its first line walks every allocation
        assert all_local
