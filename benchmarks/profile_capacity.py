"""Per-stage capacity (req/s) the latency profiles imply, and the saturation rate of each example.

A back-of-the-envelope check of the profiles, not the twin: for each example deployment
(image, video, audio) and each GPU, it draws the example's workload (seeded, ``workload``),
and computes with the profile's own latencies:

- encode: requests/s of one encode GPU at the example's batch bound B (full batches) and at
  B = 1 (Dynamo-style pass-through);
- remote prefill: requests/s of one prefill worker (its TP), one request per batch;
- local prefill: at half the SMs of the encode GPUs; where the backbone does not fit on one GPU
  (27-34B on 48 GB) a local worker must span ``min_tp`` encode GPUs, so E // min_tp workers;
- decode: requests/s of one decode worker at the largest batch its KV budget allows (≤ 256),
  from the step time at that batch and mean context;
- the example's saturation: min over stages of (replicas x capacity / share of traffic).

    python benchmarks/profile_capacity.py [--requests 4000] [--out benchmarks/out/profile_capacity]

Prints JSON, writes profile_capacity.json and profile_capacity.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b")
GPUS = ("rtx6000ada", "a100-80gb", "h200")
MAX_DECODE_BATCH = 256


def capacities(example: str, gpu: str, n: int) -> dict[str, Any]:
    from easerve_runtime.api import load_manifest
    from easerve_runtime.profiles import load_profile
    from easerve_runtime.workload import generate

    _, spec = load_manifest(ROOT / "examples" / f"{example}.yaml")
    p = load_profile(f"{example}@{gpu}")
    reqs = generate(spec, rate=1.0, n=n, seed=0)
    a, s, bb = spec.allocation, spec.offload.ratio, spec.encode.batch_bound
    items = statistics.fmean(r.encoder_items for r in reqs)
    prompt = statistics.fmean(r.prefill_tokens for r in reqs)
    out_toks = statistics.fmean(r.output_tokens for r in reqs)

    enc_b = bb / p.encode_s(max(1, round(bb * items)))
    enc_1 = 1.0 / statistics.fmean(p.encode_s(r.encoder_items) for r in reqs)
    tp_p, tp_d = a.prefill.tensor_parallel, a.decode.tensor_parallel
    pre = 1.0 / statistics.fmean(p.prefill_s(r.prefill_tokens, tp=tp_p) for r in reqs)
    # local prefill needs the backbone's weights on the encode GPU(s): on 48 GB cards a 27-34B
    # backbone only fits as a TP worker spanning min_tp encode GPUs
    tp_l = p.min_tp()
    local_workers = a.encode.replicas // tp_l
    local = 1.0 / statistics.fmean(p.prefill_s(r.prefill_tokens, sm_share=0.5, tp=tp_l) for r in reqs)
    ctx = prompt + out_toks / 2.0
    budget = p.kv_budget_bytes(tp_d)
    n_dec = (
        int(min(MAX_DECODE_BATCH, budget // max(1, p.kv_bytes(round(prompt + out_toks)))))
        if budget > 0
        else 0
    )
    dec = n_dec / p.decode_step_s(n_dec, n_dec * ctx, tp=tp_d) / out_toks if n_dec else 0.0
    tpot_at_cap = p.decode_step_s(n_dec, n_dec * ctx, tp=tp_d) if n_dec else float("inf")

    stage_total = {
        "encode": a.encode.replicas * enc_b,
        "prefill_remote": (a.prefill.replicas * pre / s) if s > 0 else float("inf"),
        "prefill_local": (local_workers * local / (1 - s)) if s < 1 else float("inf"),
        "decode": a.decode.replicas * dec,
    }
    bottleneck = min(stage_total, key=lambda k: stage_total[k])
    # the same GPUs with s = 1 (no local prefill): what the example's allocation gives without co-location
    s1 = min(stage_total["encode"], a.prefill.replicas * pre, stage_total["decode"])
    return {
        "profile": p.name,
        "allocation": a.label(),
        "batch_bound": bb,
        "offload_ratio": s,
        "mean_request": {
            "encoder_items": round(items, 2),
            "prefill_tokens": round(prompt, 1),
            "output_tokens": round(out_toks, 1),
        },
        "per_worker_req_s": {
            "encode_at_B": round(enc_b, 2),
            "encode_B1": round(enc_1, 2),
            "prefill_remote": round(pre, 2),
            "prefill_local_half_sms": round(local, 2),
            "local_prefill_tp": tp_l,
            "local_prefill_workers": local_workers,
            "decode": round(dec, 2),
        },
        "decode_batch_at_kv_limit": n_dec,
        "tpot_ms_at_that_batch": round(tpot_at_cap * 1e3, 1),
        "stage_total_req_s": {
            k: (round(v, 2) if v != float("inf") else None) for k, v in stage_total.items()
        },
        "saturation_req_s": round(stage_total[bottleneck], 2),
        "bottleneck": bottleneck,
        "saturation_if_s1_req_s": round(s1, 2),
        "local_prefill_fits_one_gpu": p.fits(1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/profile_capacity"))
    args = ap.parse_args()
    report: dict[str, dict[str, Any]] = {}
    for ex in EXAMPLES:
        report[ex] = {}
        for g in GPUS:
            print(f"  {ex}@{g} ...", file=sys.stderr)
            report[ex][g] = capacities(ex, g, args.requests)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_capacity.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        stages = ("encode", "prefill_remote", "prefill_local", "decode")
        fig, axes = plt.subplots(1, len(EXAMPLES), figsize=(13, 4), sharey=False)
        for ax, ex in zip(axes, EXAMPLES, strict=True):
            width = 0.25
            for j, g in enumerate(GPUS):
                r = report[ex][g]
                vals = [r["stage_total_req_s"][k] or 0.0 for k in stages]
                xs = [i + (j - 1) * width for i in range(len(stages))]
                ax.bar(xs, vals, width, label=f"{g} (sat {r['saturation_req_s']})")
            ax.set_xticks(range(len(stages)), [s.replace("_", "\n") for s in stages])
            ax.set_yscale("log")
            ax.axhspan(2, 4, color="grey", alpha=0.15)
            ax.set_title(f"{ex} ({report[ex]['rtx6000ada']['allocation']})", fontsize=9)
            ax.set_ylabel("stage capacity, req/s (log)")
            ax.legend(fontsize=7)
        fig.suptitle(
            "Stage capacity implied by the profiles for the example allocations (grey: paper's 2-4 req/s)"
        )
        fig.tight_layout()
        fig.savefig(out / "profile_capacity.png", dpi=120)
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no plot", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
