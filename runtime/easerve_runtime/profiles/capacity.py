"""The saturation rate (req/s) a deployment's allocation implies on its latency profile.

The frontend sizes its admission queue from this (``policies.admission``): min over stages of
replicas x per-worker capacity / that stage's share of the traffic, on the deployment's own
workload (seeded). The per-worker capacities are the same as ``benchmarks/profile_capacity.py``
reports (docs/benchmarks.md): encode at the batch bound B, remote prefill one request per batch,
local prefill at half the SMs of ``min_tp`` encode GPUs, decode at the largest batch the KV
budget allows (at most 256). A conservative estimate: the admission queue also tracks the
observed first-token rate and takes the larger of the two.
"""

from __future__ import annotations

import statistics

from easerve_runtime.api import EPDDeploymentSpec

MAX_DECODE_BATCH = 256


def saturation_rps(spec: EPDDeploymentSpec, n: int = 400, seed: int = 0) -> float:
    """Requests/s at which the first stage of ``spec``'s allocation saturates (inf if none does)."""
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
