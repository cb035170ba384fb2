"""The saturation rate (req/s) a deployment's allocation implies on its latency profile.

The frontend sizes its admission queue from this (``policies.admission``): min over stages of
replicas x per-worker capacity / that stage's share of the traffic, on the deployment's own
workload (seeded). The per-worker capacities are the same as ``benchmarks/profile_capacity.py``
reports (docs/benchmarks.md): encode at the batch bound B, remote prefill one request per batch,
local prefill at half the SMs of ``min_tp`` encode GPUs, decode at the largest batch the KV
budget allows (at most 256). A conservative estimate: the admission queue also tracks the
observed first-token rate and takes the larger of the two.

Pods that share GPUs (``easerve serve`` on a host with fewer GPUs than the allocation places,
``host_gpus``) do not add up: they time-slice the device, so the host saturates when the GPU
time one request needs in every stage fills it (``shared_gpu_rps``). Without that term a 3-pod
deployment on one H200 sized its queue from three GPUs' capacity: 27 places where the GPU
drained ~4 req/s, and admitted requests waited 2 s for a first token (run 11, docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec

MAX_DECODE_BATCH = 256


def saturation_rps(spec: EPDDeploymentSpec, n: int = 400, seed: int = 0, host_gpus: int | None = None) -> float:
    """Requests/s at which the first stage of ``spec``'s allocation saturates (inf if none does);
    with ``host_gpus`` fewer than the allocation places, the lower of that and the shared GPUs'
    rate (``shared_gpu_rps``)."""
    from easerve_runtime.profiles import spec_profile
    from easerve_runtime.workload import generate

    p = spec_profile(spec)  # a shipped name, a profile file or a mounted ConfigMap alike
    reqs = generate(spec, rate=1.0, n=n, seed=seed)
    a, s, bb = spec.allocation, spec.offload.ratio, spec.encode.batch_bound
    items = statistics.fmean(r.encoder_items for r in reqs)
    prompt = statistics.fmean(r.prefill_tokens for r in reqs)
    out_toks = max(1.0, statistics.fmean(r.output_tokens for r in reqs))
    stages: list[float] = []
    if str(spec.mode) == "aggregated":  # each engine encodes, prefills and decodes its requests itself
        agg = spec.aggregated_engine
        tp = agg.tensor_parallel
        budget = p.kv_budget_bytes(tp)
        n = int(min(MAX_DECODE_BATCH, budget // max(1, p.kv_bytes(round(prompt + out_toks))))) if budget > 0 else 1
        ctx = prompt + out_toks / 2.0
        per_req = (
            p.encode_s(max(1, round(items))) / tp
            + p.prefill_s(round(prompt), tp=tp)
            + out_toks * p.decode_step_s(max(1, n), max(1, n) * ctx, tp=tp) / max(1, n)
        )
        return agg.replicas(spec.gpu_budget) / per_req if per_req > 0 else float("inf")
    if host_gpus and host_gpus < a.gpus:
        stages.append(shared_gpu_rps(spec, p, reqs, host_gpus))
    enc_s = p.encode_s(max(1, round(bb * items)))
    stages.append(a.encode.replicas * bb / enc_s if enc_s > 0 else float("inf"))
    if s > 0:
        pre = 1.0 / statistics.fmean(p.prefill_s(r.prefill_tokens, tp=a.prefill.tensor_parallel) for r in reqs)
        stages.append(a.prefill.replicas * pre / s)
    if s < 1:
        tp_l = p.min_tp()
        local = 1.0 / statistics.fmean(p.prefill_s(r.prefill_tokens, sm_share=0.5, tp=tp_l) for r in reqs)
        stages.append(max(1, a.encode.replicas // tp_l) * local / (1 - s))
    tp_d = a.decode.tensor_parallel
    budget = p.kv_budget_bytes(tp_d)
    n_dec = int(min(MAX_DECODE_BATCH, budget // max(1, p.kv_bytes(round(prompt + out_toks))))) if budget > 0 else 0
    if n_dec:
        ctx = prompt + out_toks / 2.0
        stages.append(a.decode.replicas * n_dec / p.decode_step_s(n_dec, n_dec * ctx, tp=tp_d) / out_toks)
    return min(stages) if stages else float("inf")


def shared_gpu_rps(spec: EPDDeploymentSpec, p: Any, reqs: list[Any], host_gpus: int, rounds: int = 32) -> float:
    """Requests/s that ``host_gpus`` GPUs drain when every pod of ``spec``'s allocation time-slices
    them: ``host_gpus`` over the GPU-seconds one request takes in each stage (encode at the batch
    bound, its prefill on a whole GPU, local or remote alike, its share of decode steps and of the
    decode loop's overhead, which the twin time-slices with the step).

    A decode step's cost per request depends on the batch, and on a shared GPU the batch is not
    the KV bound: it is how many requests decode at once, which by Little's law is the rate times
    the time each spends decoding. Decoding at the objective tier's TPOT bound, that is
    ``C x output tokens x TPOT``: a fixed point in ``C``, found by iterating from the KV bound
    (each round lowers ``C`` and the batch together, so it converges from above)."""
    a, bb = spec.allocation, spec.encode.batch_bound
    items = statistics.fmean(r.encoder_items for r in reqs)
    prompt = statistics.fmean(r.prefill_tokens for r in reqs)
    out_toks = max(1.0, statistics.fmean(r.output_tokens for r in reqs))
    enc = p.encode_s(max(1, round(bb * items))) / bb
    s = spec.offload.ratio
    tp_p, tp_l, tp_d = a.prefill.tensor_parallel, p.min_tp(), a.decode.tensor_parallel
    pre = statistics.fmean(s * tp_p * p.prefill_s(r.prefill_tokens, tp=tp_p)
                           + (1 - s) * tp_l * p.prefill_s(r.prefill_tokens, tp=tp_l) for r in reqs)
    budget = p.kv_budget_bytes(tp_d)
    batch = float(min(MAX_DECODE_BATCH, budget // max(1, p.kv_bytes(round(prompt + out_toks))))) if budget > 0 else 1.0
    ctx = prompt + out_toks / 2.0
    try:
        tpot = spec.slo.tier(spec.slo.objective).tpot_ms / 1e3
    except KeyError:
        tpot = spec.slo.tiers[-1].tpot_ms / 1e3
    rate = float("inf")
    for _ in range(rounds):
        n = max(1, round(batch))
        loop_s = p.decode_overhead_s + n * getattr(p, "decode_row_overhead_s", 0.0)
        dec = out_toks * tp_d * (p.decode_step_s(n, n * ctx, tp=tp_d) + loop_s) / n
        rate = host_gpus / (enc + pre + dec)
        nxt = max(1.0, min(batch, rate * out_toks * tpot))
        if abs(nxt - batch) < 0.5:
            break
        batch = nxt
    return rate
