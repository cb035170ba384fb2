"""One HAS candidate served locally as the cluster serves its trial, against the twin (CPU).

Why: on the local cluster some trials' TTFT disagree with the twin by more than issue 13's 10 %
(the 6-encode-pod trial reads 18-27 % slow at the mean, docs/benchmarks.md runs 8-11), and a
cluster search takes ~10 minutes to show one trial again. This serves the same candidate with
``easerve serve`` (the same runtime processes the trial's pods run, the sim engine at the
cluster's speed-up and byte scale) and drives it with the same seeded ``easerve bench`` load,
mapped back to the model's time as the kube runner maps a trial; beside it, the twin for the same
candidate and requests with one frontend's admission (``easerve serve`` runs one frontend; a trial
runs one per encode pod). If a gap shows here too, its cause is in the serving path, not in the
cluster's machinery (the kubelet harness, kube-proxy, Prometheus). Each point also carries the
encode workers' own figures (``gpu_serve.encode_breakdown``) and the serving processes' CPU over the
measured requests by role (``host_cpu_s``: ``host_cpu.tree_cpu``). Measured on this host's CPUs.

    python benchmarks/trial_local.py "6E-0P(tp2)-1D(tp2) B=1 s=0" "2E-2P(tp2)-1D(tp2) B=2 s=0.7"   # ~75 s each
    python benchmarks/trial_local.py --speedup 1 "6E-0P(tp2)-1D(tp2) B=1 s=0"                      # host time once
    python benchmarks/trial_local.py --compare RUN1.json RUN2.json ...                               # side by side
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"
LABEL = re.compile(r"(\d+)E-(\d+)P\(tp(\d+)\)-(\d+)D\(tp(\d+)\) B=(\d+) s=([\d.]+)")


def log(msg: str) -> None:
    print(f"[trial_local {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def candidate(label: str) -> Any:
    """A trial's label as the cluster search prints it (``trialsDetail[].candidate``)."""
    from easerve_operator.tuning.space import Alloc, Candidate

    m = LABEL.fullmatch(label.strip())
    if m is None:
        raise SystemExit(f"candidate: expected e.g. '6E-0P(tp2)-1D(tp2) B=1 s=0', got {label!r}")
    e, p, ptp, d, dtp, b, s = m.groups()
    return Candidate(Alloc(int(e), int(p), int(ptp), int(d), int(dtp)), int(b), float(s))


def run_one(label: str, rate: float, requests: int, speedup: float, bytes_scale: float, port: int) -> dict[str, Any]:
    import gpu_serve
    from easerve_operator.tuning.runners.kube import compressed
    from easerve_operator.tuning.space import apply_candidate
    from easerve_runtime.api import load_manifest
    from easerve_runtime.sim.runner import cached_model
    from easerve_runtime.sim.systems import simulate_system
    from easerve_runtime.topology import SINGLE_HOST_FRONTENDS
    from easerve_runtime.workload.generate import generate
    from host_cpu import tree_cpu

    spec = apply_candidate(load_manifest(str(EXAMPLE))[1], candidate(label))
    work = Path(tempfile.mkdtemp(prefix="trial-local-"))
    served = compressed(spec, speedup)  # the spec the cluster's sped-up trial pods run
    doc = {**yaml.safe_load(EXAMPLE.read_text()), "spec": served.model_dump(mode="json", by_alias=True, exclude_none=True)}
    doc["spec"]["discovery"] = {"backend": "file"}
    f = work / "spec.yaml"
    f.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "EASERVE_SIM_SPEEDUP": f"{speedup:g}", "EASERVE_SIM_BYTES_SCALE": f"{bytes_scale:g}"}
    srv = gpu_serve.Serve(f, work, port, env)
    try:
        srv.wait(180)
        # warm-up, not recorded (the trial's warm-up is cut too)
        gpu_serve.bench_point(srv.url, f, rate * speedup, 8, 99, env, client=gpu_serve.SIM_CLIENT)
        before = gpu_serve.worker_metrics(work)
        pre_before = gpu_serve.prefill_metrics(work)
        cpu_before = tree_cpu(srv.proc.pid)
        log(f"{label}: {requests} requests at {rate:g} req/s (model time; {rate * speedup:g} wall)")
        rep = gpu_serve.bench_point(srv.url, f, rate * speedup, requests, 1, env, client=gpu_serve.SIM_CLIENT)
        cpu = {r: round(v - cpu_before.get(r, 0.0), 2) for r, v in tree_cpu(srv.proc.pid).items()}
        enc = gpu_serve.encode_breakdown(before, gpu_serve.worker_metrics(work))
        pre = gpu_serve.prefill_breakdown(pre_before, gpu_serve.prefill_metrics(work))
    finally:
        srv.stop()
    res = simulate_system(spec, generate(spec, rate, requests, 1), "easerve", cached_model(spec),
                         frontends=SINGLE_HOST_FRONTENDS)
    k = speedup
    live = {"throughput": rep["throughput"] / k, "ttft_mean": rep["ttft"]["mean"] * k, "ttft_p50": rep["ttft"]["p50"] * k,
            "ttft_p99": rep["ttft"]["p99"] * k, "failed": rep.get("failed", 0)}
    twin = {"throughput": res.summary["throughput"], "ttft_mean": res.summary["ttft_mean"],
            "ttft_p50": res.summary["ttft"]["p50"], "ttft_p99": res.summary["ttft_p99"],
            "failed": int(res.stats.get("admission", {}).get("refused", 0))}
    ratios = {key: round(live[key] / twin[key], 3) for key in ("throughput", "ttft_mean", "ttft_p50", "ttft_p99") if twin[key]}
    return {"candidate": label, "served": {key: round(v, 4) for key, v in live.items()},
            "twin": {key: round(v, 4) for key, v in twin.items()}, "served_over_twin": ratios, "encode": enc,
            "prefill": pre, "host_cpu_s": {"by_role": cpu, "total": round(sum(cpu.values()), 2),
                                           "per_request_ms": round(1e3 * sum(cpu.values()) / requests, 1)}}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("throughput", "ttft_p50", "ttft_mean", "ttft_p99")
    fig, ax = plt.subplots(figsize=(9, 4))
    pts = out["points"]
    w = 0.8 / max(1, len(pts))
    for i, p in enumerate(pts):
        ax.bar([x + i * w for x in range(len(keys))], [p["served_over_twin"].get(k, 0) for k in keys], w,
               label=p["candidate"])
    ax.axhline(1.0, color="grey", lw=0.8)
    for y in (0.9, 1.1):
        ax.axhline(y, color="grey", lw=0.5, ls=":")
    ax.set_xticks([x + w * (len(pts) - 1) / 2 for x in range(len(keys))], keys)
    ax.set(ylabel="served locally / twin", title=f"trials served locally at {out['rate']:g} req/s, speed-up "
           f"{out['speedup']:g} (CPU; twin with one frontend)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def compare(files: list[str], path: Path) -> dict[str, Any]:
    """Several runs' served/twin ratios side by side (mean and P99 TTFT, per candidate), one panel
    each, for runs of the same candidates with different code (each file's ``label`` says which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(f).stem, json.loads(Path(f).read_text())) for f in files]
    table = {name: {p["candidate"]: {k: p["served_over_twin"][k] for k in ("ttft_mean", "ttft_p99", "throughput")}
                    | {"label": r.get("label", "")} for p in r["points"]} for name, r in runs}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    cands = list(dict.fromkeys(c for t in table.values() for c in t))
    w = 0.8 / max(1, len(runs))
    for ax, key in zip(axes, ("ttft_mean", "ttft_p99"), strict=True):
        for i, (name, r) in enumerate(runs):
            ax.bar([x + i * w for x in range(len(cands))], [table[name].get(c, {}).get(key, 0) for c in cands], w,
                   label=f"{name} ({r.get('label', '')})")
        ax.axhline(1.0, color="grey", lw=0.8)
        for y in (0.9, 1.1):
            ax.axhline(y, color="grey", lw=0.5, ls=":")
        ax.set_xticks([x + w * (len(runs) - 1) / 2 for x in range(len(cands))], [re.sub(r"-(?=\dD)| (?=B=)", "\n", c) for c in cands],
                      fontsize=7)
        ax.set(title=f"{key}: served locally / twin (CPU)", ylim=(0.6, 1.4))
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("candidates", nargs="*", help="trial labels, e.g. '6E-0P(tp2)-1D(tp2) B=1 s=0'")
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                    help="plot these trial_local runs side by side instead of serving (--plot names the PNG)")
    ap.add_argument("--label", default="", help="what this run's code is, recorded in the JSON (for --compare)")
    ap.add_argument("--rate", type=float, default=3.0, help="model-time rate (req/s), as the search's target")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--speedup", type=float, default=2.0, help="the sim engine's speed-up (the cluster runs 2)")
    ap.add_argument("--bytes-scale", type=float, default=0.01, help="materialised embedding bytes (cluster: 0.01)")
    ap.add_argument("--port", type=int, default=18641)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "trial_local.png"))
    args = ap.parse_args()
    if args.compare:
        print(json.dumps(compare(args.compare, Path(args.plot)), indent=1))
        return 0
    if not args.candidates:
        ap.error("give at least one candidate label, or --compare FILES")
    for c in args.candidates:
        candidate(c)  # refuse a bad label before serving anything
    out: dict[str, Any] = {"bench": "trial_local", "measured": "cpu (this host): easerve serve + easerve bench vs twin",
                           "rate": args.rate, "requests": args.requests, "speedup": args.speedup,
                           "bytes_scale": args.bytes_scale, "label": args.label, "points": []}
    for i, c in enumerate(args.candidates):
        out["points"].append(run_one(c, args.rate, args.requests, args.speedup, args.bytes_scale, args.port + i))
        log(json.dumps(out["points"][-1]["served_over_twin"]))
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    plot(out, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
