"""HAS Stage 1 on real workers: one stage's capacity, measured on the engine its pods run.

``easerve profile-stage`` runs this in a profiling Job (one per stage kind, on GPUs of its own), so
the operator's Stage 1 scores allocations by what this cluster's engine does, not by a model. The
probes are the twin profiler's (``sim.profiler.SimProfiler``), run live:

- **encode** (``B``): one encode engine encodes the sample in back-to-back micro-batches of B
  requests, built from chat bodies by the frontend's own parser (``openai.parse_chat_request``),
  so the engine sees what a pod's encoder sees. B doubles 1, 2, 4, ... up to ``max_batch``.
- **prefill** (``tp``): one prefill engine at TP ``tp``, every request queued at t = 0, batched by
  the shared ``PrefillBatcher`` (``spec.prefill.maxBatchTokens``): requests / time to the last
  first token. ``local_shares``: the same at the SM shares the local prefill worker gets (the
  operator passes the partition policy's shares), for α, on the first ``LOCAL_SAMPLE`` requests;
  a share under ``MIN_LOCAL_SHARE`` counts as capacity 0.
- **decode** (``tp``): the live ``DecodeWorker`` (its ``DecodeAdmission`` over the engine's KV
  capacity) with every sequence queued at t = 0: requests / time to the last token.

All figures are requests/s of the deployment's workload, in the model's time: a sim engine running
k times faster than modelled (``EASERVE_SIM_SPEEDUP``) has its wall times multiplied back by k
(``time_scale`` in the report). ``cost_s`` is the device time each probe took, in the same units.

The sim and torch engines both profile encode; prefill and decode need the sim engine here (a
torch prefill needs the encoder's real embeddings, a torch decode a real KV cache: both are the
``easerve profile --engine torch`` work of issue 17). For those the report says ``unsupported``
and the operator falls back to the twin's profile for that stage, saying so.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

from easerve_runtime.api import Backend, EPDDeploymentSpec, StageAllocation
from easerve_runtime.engines.base import EncodeInput, PrefillInput, Sampling
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.prefill_batch import PrefillBatcher
from easerve_runtime.workload import generate
from easerve_runtime.workload.request import Request

LOCAL_SAMPLE = 32
"""Requests of the sample the local prefill probes use: they run at a fraction of the GPU, and α
needs a ratio, not a long run."""
MIN_LOCAL_SHARE = 0.02
"""Below this SM share a local prefill worker makes next to no progress while the encoder runs (the
dynamic split gives it ~0.1 % during a batch): its capacity there counts as 0, not measured (a
probe at 0.1 % would take a thousand times the full-GPU run)."""
DEFAULT_REQUESTS = 256
"""The twin profiler's sample size (``runners.sim.DEFAULT_PROFILE_REQUESTS``): the same requests."""
SPEEDUP_ENV = "EASERVE_SIM_SPEEDUP"


def time_scale(spec: EPDDeploymentSpec) -> float:
    """k: how much faster than modelled this process's sim engine runs (1 for a real engine)."""
    if str(spec.engine.backend) != Backend.SIM:
        return 1.0
    return float(os.environ.get(SPEEDUP_ENV) or 1.0)


def batches_up_to(n: int) -> list[int]:
    out, b = [], 1
    while b <= n:
        out.append(b)
        b *= 2
    return out


def encode_inputs(spec: EPDDeploymentSpec, reqs: Sequence[Request], image_format: str = "png") -> list[EncodeInput]:
    """The sample as the frontend hands it to the encoder (its parser, its limits); images in
    ``image_format`` (``easerve bench --image-format``: png or jpeg)."""
    from easerve_runtime.bench.payloads import chat_body
    from easerve_runtime.workers.openai import parse_chat_request

    name = spec.served_model_name
    out = []
    for r in reqs:
        chat = parse_chat_request(chat_body(r, name, stream=False, image_format=image_format), (name,), str(spec.model.modality), spec.limits)
        out.append(EncodeInput(r.id, tuple(chat.parts), chat.seed, tuple(chat.messages)))
    return out


def with_tp(spec: EPDDeploymentSpec, stage: str, tp: int) -> EPDDeploymentSpec:
    """The spec of one worker of ``stage`` at TP ``tp`` (what its engine is built for)."""
    a = spec.allocation
    one = StageAllocation(replicas=max(1, getattr(a, stage).replicas), tensor_parallel=tp)
    return spec.model_copy(update={"allocation": a.model_copy(update={stage: one})})


class StageProfiler:
    """The live probes for one deployment (see the module docstring); wall time through ``clock``."""

    def __init__(self, spec: EPDDeploymentSpec, requests: int = DEFAULT_REQUESTS, seed: int = 0) -> None:
        self.spec = spec
        self.reqs = generate(spec, 1.0, requests, seed)
        self.k = time_scale(spec)
        self.clock = time.perf_counter

    def _probe(self, n: int, wall: float) -> dict[str, float]:
        model_s = wall * self.k
        return {"value": n / model_s if model_s > 0 else float("inf"), "cost_s": model_s}

    # ----------------------------------------------------------------- encode
    async def encode(self, batches: Sequence[int]) -> list[dict[str, float]]:
        from easerve_runtime.workers.main import make_engine

        engine = make_engine(self.spec, "encode")
        inputs = encode_inputs(self.spec, self.reqs)
        await engine.encode(inputs[:1])  # warm-up (a real engine captures graphs, loads kernels)
        curve = []
        for b in batches:
            t0 = self.clock()
            for i in range(0, len(inputs), b):
                await engine.encode(inputs[i : i + b])
            curve.append({"batch": b, **self._probe(len(inputs), self.clock() - t0)})
        return curve

    # ----------------------------------------------------------------- prefill
    def _prefill_inputs(self, engine: Any) -> list[tuple[PrefillInput, int]]:
        mm_of = getattr(engine, "mm_tokens", None)
        if mm_of is None:
            raise NotImplementedError("prefill profiling needs the sim engine (the torch engine: issue 17)")
        out = []
        for inp, r in zip(encode_inputs(self.spec, self.reqs), self.reqs, strict=True):
            mm = int(mm_of(inp.parts))
            out.append((PrefillInput(r.id, r.prompt_tokens, mm, inp.seed, sampling=Sampling()), r.prompt_tokens + mm))
        return out

    def _engine(self, stage: str, tp: int) -> Any:
        from easerve_runtime.workers.main import make_engine

        engine = make_engine(self.spec, stage)
        if tp != getattr(engine, "tp", 1):
            if not hasattr(engine, "tp"):
                raise NotImplementedError(f"{stage} at TP {tp} needs the sim engine (the torch engine runs TP 1)")
            engine.tp = tp  # one worker of this TP (the sim engine reads it per call)
        return engine

    async def prefill(self, tp: int, share: float = 1.0, sample: int | None = None) -> dict[str, float]:
        if share < MIN_LOCAL_SHARE:
            return {"value": 0.0, "cost_s": 0.0, "below_min_share": True}
        engine = self._engine("prefill", tp)
        batcher: PrefillBatcher[PrefillInput] = PrefillBatcher.for_spec(self.spec.prefill)
        batcher.extend(self._prefill_inputs(engine)[:sample])
        n = batcher.pending
        t0 = self.clock()
        while batcher:
            batch, _ = batcher.take()
            await engine.prefill(batch, share)
        return self._probe(n, self.clock() - t0)

    # ----------------------------------------------------------------- decode
    async def decode(self, tp: int) -> dict[str, float]:
        from easerve_runtime.workers.decode import DecodeWorker

        spec = with_tp(self.spec, "decode", tp)  # the worker sizes its KV budget by its TP
        engine = self._engine("decode", tp)
        if getattr(engine, "mm_tokens", None) is None:
            raise NotImplementedError("decode profiling needs the sim engine (the torch engine: issue 17)")
        worker = DecodeWorker.for_spec(spec, engine, Metrics())
        mm = [int(engine.mm_tokens(i.parts)) for i in encode_inputs(self.spec, self.reqs)]

        async def one(r: Request, media: int) -> None:
            req = {"id": r.id, "context_tokens": r.prompt_tokens + media, "max_tokens": r.output_tokens,
                   "first_token": 0, "seed": 0, "kv_bytes": 0, "ignore_eos": True}
            async for item in worker.generate(req):
                if "error" in item:
                    raise RuntimeError(item["error"])

        runner = asyncio.create_task(worker.run())
        try:
            t0 = self.clock()
            await asyncio.gather(*(one(r, m) for r, m in zip(self.reqs, mm, strict=True)))
            return self._probe(len(self.reqs), self.clock() - t0)
        finally:
            runner.cancel()


async def profile(
    spec: EPDDeploymentSpec,
    stage: str,
    *,
    tps: Sequence[int] = (1,),
    max_batch: int = 16,
    local_shares: Sequence[float] = (),
    requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
) -> dict[str, Any]:
    """The report of one profiling Job: the probes of ``stage`` (module docstring)."""
    p = StageProfiler(spec, requests, seed)
    t0 = time.time()
    out: dict[str, Any] = {
        "stage": stage, "backend": str(spec.engine.backend), "time_scale": p.k, "requests": len(p.reqs),
    }
    try:
        if stage == "encode":
            out["encode"] = await p.encode(batches_up_to(max_batch))
        elif stage == "prefill":
            out["prefill"] = {str(tp): await p.prefill(tp) for tp in tps}
            if local_shares:  # α = C_local / C_P on the same (short) sample
                out["local_ref"] = await p.prefill(min(tps), 1.0, LOCAL_SAMPLE)
                out["local"] = {f"{s:.6g}": await p.prefill(min(tps), s, LOCAL_SAMPLE) for s in local_shares}
        elif stage == "decode":
            out["decode"] = {str(tp): await p.decode(tp) for tp in tps}
        else:
            raise ValueError(f"--stage: encode, prefill or decode, got {stage!r}")
    except NotImplementedError as exc:
        out["unsupported"] = str(exc)
    out["wall_s"] = time.time() - t0
    return out
