"""The saturation rate of pods that time-slice fewer host GPUs than their allocation places
(``profiles.capacity.shared_gpu_rps``): what ``easerve serve`` on one GPU sizes its admission
queue from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_runtime.api import EPDDeploymentSpec, parse_spec
from easerve_runtime.profiles import spec_profile
from easerve_runtime.profiles.capacity import saturation_rps, shared_gpu_rps
from easerve_runtime.workload import generate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llava-v1.6-34b.yaml"


def spec(**update: Any) -> EPDDeploymentSpec:
    doc = yaml.safe_load(EXAMPLE.read_text())["spec"]
    tp = update.pop("prefill_tp", 1)
    doc["gpuBudget"] = 2 + tp
    doc["allocation"] = {"encode": {"replicas": 1}, "prefill": {"replicas": 1, "tensorParallel": tp},
                         "decode": {"replicas": 1}}
    doc.setdefault("offload", {})["ratio"] = update.pop("s", 0.5)
    doc.setdefault("encode", {})["batchBound"] = update.pop("b", 4)
    return parse_spec(doc | update)


def shared(s: EPDDeploymentSpec, host_gpus: int) -> float:
    return shared_gpu_rps(s, spec_profile(s), generate(s, rate=1.0, n=400, seed=0), host_gpus)


def test_enough_host_gpus_change_nothing_and_fewer_lower_the_rate() -> None:
    s = spec()
    whole = saturation_rps(s)
    assert saturation_rps(s, host_gpus=3) == whole == saturation_rps(s, host_gpus=8)
    one = saturation_rps(s, host_gpus=1)
    assert 0 < one < whole
    assert one == pytest.approx(shared(s, 1))  # on one GPU the time-slicing is what binds


def test_more_shared_gpus_drain_at_least_proportionally() -> None:
    """Twice the GPUs drain twice the requests, and a little more: at twice the rate the decode
    batch (rate x output tokens x TPOT) is larger, so each request's share of a step is smaller."""
    s = spec()
    assert shared(s, 2) >= 2 * shared(s, 1) * (1 - 1e-9)


def test_a_prefill_costs_the_same_gpu_time_local_or_remote_on_a_shared_gpu() -> None:
    """On one GPU a prefill takes its GPU time wherever it runs (the twin's time-slicing), so the
    offload ratio does not move the shared rate when the remote prefill has the local one's TP (the
    34B needs two GPUs' memory: ``min_tp`` 2 at this spec's memory fraction); a larger encode batch
    does move it (per image)."""
    tp = spec_profile(spec()).min_tp()
    rates = {ratio: shared(spec(s=ratio, prefill_tp=tp), 1) for ratio in (0.0, 0.5, 0.9)}
    assert rates[0.0] == pytest.approx(rates[0.5]) == pytest.approx(rates[0.9])
    assert shared(spec(b=8), 1) >= shared(spec(b=1), 1)


def test_the_frontend_sizes_its_queue_from_the_shared_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from easerve_runtime.api import RuntimeConfig
    from easerve_runtime.topology import SHARED_GPUS_ENV
    from easerve_runtime.workers.frontend import FRONTENDS_ENV, measured_capacity

    c = RuntimeConfig(name="t", dynamo_namespace="ns_t", spec=spec())
    monkeypatch.delenv("EASERVE_SIM_SPEEDUP", raising=False)
    monkeypatch.setenv(FRONTENDS_ENV, "1")
    monkeypatch.delenv(SHARED_GPUS_ENV, raising=False)
    whole = measured_capacity(c)
    monkeypatch.setenv(SHARED_GPUS_ENV, "1")
    assert measured_capacity(c) == pytest.approx(saturation_rps(c.spec, host_gpus=1))
    assert measured_capacity(c) < whole
