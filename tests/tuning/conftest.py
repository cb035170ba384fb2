"""Deterministic TEST DOUBLES for the HAS tests (not the twin).

``AnalyticTestRunner`` and ``TableTestProfiler`` are hand-built closed-form stand-ins that make
every expected number computable by hand; the real trial runner and profiler are the twin's
(``easerve_operator.tuning.runners.sim``), exercised separately in ``test_sim_runner.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from easerve_operator.tuning.runners import Probe, TrialMetrics
from easerve_runtime.api import EPDDeploymentSpec, load_manifest

ROOT = Path(__file__).resolve().parents[2]


class TableTestProfiler:
    """Profiler test double answering from fixed tables (capacities in req/s)."""

    def __init__(
        self,
        encode: dict[int, float] | None = None,
        prefill: dict[int, float] | None = None,
        decode: dict[int, float] | None = None,
        alpha: float | None = 0.3,
        min_tp: int = 2,
    ) -> None:
        self.encode = encode or {1: 1.0, 2: 1.8, 4: 2.6, 8: 2.7, 16: 2.72}
        self.prefill = prefill or {2: 1.5, 4: 2.5, 8: 4.0}
        self.decode = decode or {2: 2.0, 4: 3.5, 8: 6.0}
        self.alpha = alpha
        self._min_tp = min_tp
        self.calls: list[tuple[str, int]] = []

    def min_tp(self) -> int:
        return self._min_tp

    def encode_throughput(self, batch: int) -> Probe:
        self.calls.append(("E", batch))
        return Probe(self.encode[batch], cost_s=10.0)

    def prefill_capacity(self, tp: int) -> Probe:
        self.calls.append(("P", tp))
        return Probe(self.prefill[tp], cost_s=20.0)

    def decode_capacity(self, tp: int) -> Probe:
        self.calls.append(("D", tp))
        return Probe(self.decode[tp], cost_s=30.0)

    def local_prefill_efficiency(self) -> float | None:
        return self.alpha


def analytic_metrics(spec: EPDDeploymentSpec, rate: float) -> TrialMetrics:
    """A closed-form pipeline: throughput is the tightest stage, capped by the offered rate.

    Encode capacity saturates in B and loses 20% at s = 0 (local prefill shares the GPU);
    remote and local prefill take s and 1 − s of the load. Latency grows with B (batching wait)
    and away from s = 0.6, so the (B, s) surface has an interior optimum for TTFT.
    """
    a = spec.allocation
    b = spec.encode.batch_bound
    s = spec.offload.ratio
    cp = {1: 0.8, 2: 1.5, 4: 2.5, 8: 4.0}[a.prefill.tensor_parallel]
    cd = {1: 1.0, 2: 2.0, 4: 3.5, 8: 6.0}[a.decode.tensor_parallel]
    cap_e = a.encode.replicas * 3.2 * b / (b + 1.5) * (1 - 0.2 * (1 - s))
    caps = [rate, cap_e, a.decode.replicas * cd]
    if s > 0:
        caps.append(a.prefill.replicas * cp / s)
    if s < 1:
        caps.append(a.encode.replicas * 0.3 * cp / (1 - s))
    thr = min(caps)
    ttft = 0.5 + 0.1 * b + 0.3 * abs(s - 0.6)
    tpot = 0.05 + 0.01 * a.decode.replicas
    good = {"strict": thr * 0.5, "moderate": thr * (0.9 if ttft < 1.0 else 0.6), "relaxed": thr}
    return TrialMetrics(thr, ttft, tpot, good, completed=100, cost_s=100 / max(thr, 1e-9))


class AnalyticTestRunner:
    """TrialRunner test double over ``analytic_metrics``; counts and logs every trial."""

    def __init__(self, fail_on: set[tuple[str, int, float]] | None = None) -> None:
        self.log: list[tuple[str, int, float]] = []
        self.fail_on = fail_on or set()

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> TrialMetrics:
        key = (spec.allocation.label(), spec.encode.batch_bound, round(spec.offload.ratio, 6))
        self.log.append(key)
        if key in self.fail_on:
            raise RuntimeError(f"rollout failed for {key}")
        return analytic_metrics(spec, rate)


class FakeClock:
    """Deterministic clock for wall-time fields: advances 1 s per reading."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def image_spec() -> EPDDeploymentSpec:
    return load_manifest(ROOT / "examples" / "llava-v1.6-34b.yaml")[1]


@pytest.fixture
def profiler() -> TableTestProfiler:
    return TableTestProfiler()


@pytest.fixture
def runner() -> AnalyticTestRunner:
    return AnalyticTestRunner()


@pytest.fixture
def td():
    """The test doubles, as a namespace (test modules cannot import conftest by name)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        TableTestProfiler=TableTestProfiler,
        AnalyticTestRunner=AnalyticTestRunner,
        FakeClock=FakeClock,
        analytic_metrics=analytic_metrics,
    )
