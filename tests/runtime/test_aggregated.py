"""``spec.mode: aggregated``: the vLLM-style baseline on the same engines, through the spec, the
topology, the worker and ``easerve serve`` (sim engine; the torch engine is in
tests/engines/test_torch_aggregated.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.api import DeploymentMode, Stage, parse_spec
from easerve_runtime.engines.base import MediaPart
from easerve_runtime.engines.sim import SimEngine, token_at
from easerve_runtime.metrics import Metrics
from easerve_runtime.topology import plan
from easerve_runtime.workers.aggregated import AggregatedWorker
from easerve_runtime.workers.wire import part_to_wire
from pydantic import ValidationError
from serve_process import serve_process

BASE: dict[str, Any] = {
    "model": {"name": "llava-hf/llava-v1.6-34b-hf", "modality": "image", "encoder": "clip-vit-l-336"},
    "engine": {"backend": "sim", "profile": "llava-v1.6-34b@h200"},
    "gpuBudget": 2,
    "mode": "aggregated",
    "slo": {"objective": "m", "tiers": [{"name": "m", "ttftSeconds": 8, "tpotMs": 100}]},
}


def spec(**kw: Any) -> Any:
    return parse_spec({**BASE, **kw})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"allocation": {"encode": {"replicas": 2}}}, "spec.allocation"),
        ({"offload": {"ratio": 0.5}}, "spec.offload"),
        ({"smPartition": {"mode": "dynamic"}}, "spec.smPartition"),
        ({"encode": {"batchBound": 4}}, "spec.encode"),
        ({"prefill": {"maxBatchTokens": 4096}}, "spec.prefill"),
        ({"tuning": {"enabled": True, "targetRate": 1.0}}, "spec.tuning.enabled"),
        ({"gpuBudget": 3, "aggregated": {"tensorParallel": 2}}, "spec.gpuBudget"),
    ],
)
def test_aggregated_mode_refuses_the_disaggregated_knobs_naming_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=rf"{field}: "):
        spec(**extra)


def test_aggregated_section_only_in_aggregated_mode_and_torch_is_tp1() -> None:
    with pytest.raises(ValidationError, match="spec.aggregated: is only valid when spec.mode is aggregated"):
        spec(mode="disaggregated", aggregated={"tokenBudget": 512})
    torch_engine = {"backend": "torch", "profile": "llava-v1.6-34b@h200"}
    model = {**BASE["model"], "path": "/models/x"}
    with pytest.raises(ValidationError, match="spec.aggregated.tensorParallel: is 2, but the torch engine"):
        spec(engine=torch_engine, model=model, aggregated={"tensorParallel": 2})
    s = spec(decode={"maxSequences": 8})  # spec.decode applies: the worker admits by it
    assert s.aggregated_engine.token_budget == 2048 and s.decode.max_sequences == 8
    # the defaults written out (a config file round trip) are not refused
    assert parse_spec(json.loads(json.dumps(s.model_dump(mode="json", by_alias=True)))) == s


def test_topology_is_one_worker_per_tp_gpus_with_a_frontend() -> None:
    topo = plan(spec(gpuBudget=4, aggregated={"tensorParallel": 2, "tokenBudget": 512}))
    assert topo.mode == DeploymentMode.AGGREGATED and len(topo.pods) == 1
    pod = topo.pods[0]
    assert pod.stage == Stage.AGGREGATED and pod.replicas == 2 and pod.gpus == 2 and topo.gpus == 4
    fe, worker = pod.processes
    assert fe.stage == Stage.FRONTEND and fe.http_port is not None
    assert worker.stage == Stage.AGGREGATED and worker.tp == 2 and worker.owns == (0, 1)
    assert worker.argv[:4] == ("easerve", "worker", "--stage", "aggregated")


def test_operator_renders_an_aggregated_deployment_over_dynamo() -> None:
    from easerve_operator.render import render_children

    objs = render_children("agg", "default", "uid", spec())
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"frontend", "aggregated"}
    env = {e["name"] for e in containers["aggregated"]["env"]}
    assert "DYN_NAMESPACE" in env
    assert containers["aggregated"]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def wire(i: int, max_tokens: int, images: int = 1) -> dict[str, Any]:
    part = MediaPart("image", b"", "image/png", {"height": 336, "width": 336})
    return {"id": f"r{i}", "seed": 100 + i, "text_tokens": 40 + i, "max_tokens": max_tokens,
            "parts": [part_to_wire(part)] * images}


async def ask(w: AggregatedWorker, req: dict[str, Any]) -> dict[str, Any]:
    tokens: list[int] = []
    async for item in w.generate(req):
        assert "error" not in item, item
        if "token" in item:
            tokens.append(item["token"])
        elif item.get("done"):
            return {"tokens": tokens, **item}
    raise AssertionError("no done item")


def test_sim_worker_batches_chunks_and_streams_every_token() -> None:
    s = spec(aggregated={"tokenBudget": 256})
    engine = SimEngine.for_spec(s, "aggregated", speedup=200.0)
    w = AggregatedWorker.for_spec(s, (engine, engine, engine), Metrics())
    assert w.chunked and w.planner.token_budget == 256
    prefills: list[int] = []
    orig = engine.prefill_chunks

    async def recording(chunks: Any, share: float = 1.0) -> Any:
        prefills.append(sum(n for _r, _s, n in chunks))
        return await orig(chunks, share)

    engine.prefill_chunks = recording  # type: ignore[method-assign]

    async def main() -> list[dict[str, Any]]:
        task = asyncio.create_task(w.run())
        try:
            first = asyncio.create_task(ask(w, wire(0, 40)))
            await asyncio.sleep(0.05)  # request 0 is decoding when the others arrive
            rest = await asyncio.gather(*(ask(w, wire(i, 10 + i)) for i in range(1, 6)))
            return [await first, *rest]
        finally:
            task.cancel()

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        n = 40 if i == 0 else 10 + i
        assert out["tokens"] == [token_at(100 + i, k) for k in range(n)]
        assert out["route"] == "aggregated" and out["finish_reason"] == "length"
        assert out["prompt_tokens"] == 40 + i + engine.mm_tokens([MediaPart("image", b"", "", {"height": 336, "width": 336})])
    assert w.max_batch >= 2  # requests joined a running batch
    assert max(prefills) <= 256 and len(prefills) > len(outs)  # prompts (~2.2k tokens) were chunked
    assert w.planner.running == 0 and w.planner.reserved == pytest.approx(0.0, abs=1e-3) and not len(w.planner)


def test_sim_worker_frees_a_cancelled_request() -> None:
    s = spec()
    engine = SimEngine.for_spec(s, "aggregated", speedup=200.0)
    w = AggregatedWorker.for_spec(s, (engine, engine, engine), Metrics())

    async def main() -> dict[str, Any]:
        task = asyncio.create_task(w.run())
        try:
            gen = w.generate(wire(0, 10_000))
            got = 0
            async for item in gen:
                got += "token" in item
                if got == 3:
                    break
            await gen.aclose()  # the caller goes away
            for _ in range(200):
                if not w._running:
                    break
                await asyncio.sleep(0.01)
            assert not w._running and w.planner.running == 0
            return await ask(w, wire(1, 5))
        finally:
            task.cancel()

    assert len(asyncio.run(main())["tokens"]) == 5


# -- easerve serve, end to end ---------------------------------------------------------------
SERVE_SPEC = """apiVersion: easerve.io/v1alpha1
kind: EPDDeployment
metadata: {name: agg-sim}
spec:
  model: {name: llava-hf/llava-v1.6-34b-hf, modality: image, encoder: clip-vit-l-336}
  engine: {backend: sim, profile: llava-v1.6-34b@h200}
  mode: aggregated
  aggregated: {tokenBudget: 1024}
  gpuBudget: 2
  slo: {objective: m, tiers: [{name: m, ttftSeconds: 8, tpotMs: 100}]}
  discovery: {backend: file}
  limits: {maxQueuedRequests: 400}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("agg-serve")
    env = {"EASERVE_SIM_SPEEDUP": "10", "EASERVE_SIM_BYTES_SCALE": "0.01"}
    with serve_process(SERVE_SPEC, tmp, env, timeout_s=120) as (port, wd):
        yield f"http://127.0.0.1:{port}", wd


@pytest.mark.slow
def test_easerve_serve_aggregated_sim_answers_a_bench_load(served: tuple[str, Path]) -> None:
    url, wd = served
    procs = json.loads((wd / "processes.json").read_text())["processes"]
    assert sorted(p["stage"] for p in procs) == ["aggregated", "aggregated", "frontend", "frontend"]
    cmd = [sys.executable, "-m", "easerve_operator.cli", "bench", "--url", url, "--rate", "20", "--requests", "60",
           "--seed", "4", "--output-mean", "6", "--prompt-mean", "16", "--json"]
    out = subprocess.run(cmd, capture_output=True, timeout=300, check=False)
    assert out.stdout, out.stderr.decode()[-2000:]
    rep = json.loads(out.stdout)
    assert rep["completed"] == 60 and rep["failed"] == 0, rep["errors"]
    assert rep["token_count_mismatches"] == 0
    assert rep["routes"] == {"aggregated": 60}
