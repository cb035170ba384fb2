"""Tenants that poll the partition record against tenants the controller wakes, side by side (CPU).

Why: an encode pod whose GPU also runs a local prefill has three processes that meet at the SM
partition record: the encoder (primary), the local prefill (partner) and the controller. Since
session 16 the controller sleeps until a tenant pokes it (``partition/wake.py``). The tenants still
re-read the record every 0.5 ms while they waited for an answer: the partner for the whole of each
micro-batch its encoder runs (the dynamic split grants it no SMs then), the encoder up to 3 ms for
its batch's split. On the 2-core local cluster a 6-encode-pod trial (every prefill local) runs six
partners, and its mean TTFT read 18-27 % over the twin's (docs/benchmarks.md, runs 8-11). Now the
controller pokes the tenants back after each new split (``EASERVE_PARTITION_TENANTS_POLL=1``
restores the re-reading, for this comparison).

The run: ``easerve serve`` of the LLaVA example (sim engine) laid out as the cluster's 6E-0P
trial (six encode pods, every prefill local, ``smPartition: dynamic``), once with polling tenants
and once with woken ones, each driven by the same seeded ``easerve bench`` load; the CPU time of
every process over the load window (``/proc/PID/stat``) by role, and the bench's own TTFT and
throughput. Prints one JSON object; saves a PNG. Measured on this machine's CPUs: what it compares
is CPU per role and latency on the same host, in one run, as ratios.

    python benchmarks/partition_wakeups.py --rate 3 --requests 150     # ~2.5 min on 2 cores
    python benchmarks/partition_wakeups.py --summary                   # the committed runs, one plot
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"
TICKS = os.sysconf("SC_CLK_TCK")
MODES = {"polling tenants": {"EASERVE_PARTITION_TENANTS_POLL": "1"}, "woken tenants": {}}


def log(msg: str) -> None:
    print(f"[partition_wakeups {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spec_file(work: Path, encode: int) -> Path:
    """The example as the cluster's all-local trial: ``encode`` encode pods, no remote prefill."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    s = doc["spec"]
    s["allocation"] = {"encode": {"replicas": encode, "tensorParallel": 1},
                       "prefill": {"replicas": 0, "tensorParallel": 2},
                       "decode": {"replicas": 1, "tensorParallel": 2}}
    s["gpuBudget"] = encode + 2
    s["offload"] = {"ratio": 0.0}
    s["discovery"] = {"backend": "file"}
    f = work / "spec.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def role_of(p: dict[str, Any]) -> str:
    stage = str(p.get("stage", ""))
    if "partition" in stage:
        return "partition controller"
    if "local" in stage:
        return "local prefill (partner)"
    return stage or "?"


def run_mode(name: str, env_extra: dict[str, str], spec: Path, port: int, rate: float, requests: int,
             seed: int) -> dict[str, Any]:
    from gpu_serve import SIM_CLIENT, Serve, bench_point

    work = Path(tempfile.mkdtemp(prefix="pw-"))
    env = {k: v for k, v in os.environ.items() if k != "EASERVE_PARTITION_TENANTS_POLL"} | env_extra
    srv = Serve(spec, work, port, env)
    try:
        srv.wait(180)
        procs = json.loads((work / "wd" / "processes.json").read_text())["processes"]
        log(f"{name}: {len(procs)} processes up; load {rate} req/s x {requests}")
        before = {p["pid"]: cpu_s(p["pid"]) for p in procs}
        t0 = time.monotonic()
        report = bench_point(srv.url, spec, rate, requests, seed, env, client=SIM_CLIENT)
        wall = time.monotonic() - t0
        after = {p["pid"]: cpu_s(p["pid"]) for p in procs}
    finally:
        srv.stop()
    roles: dict[str, dict[str, float]] = {}
    for p in procs:
        r = roles.setdefault(role_of(p), {"processes": 0, "cpu_s": 0.0})
        r["processes"] += 1
        r["cpu_s"] += after[p["pid"]] - before[p["pid"]]
    for r in roles.values():
        r["cores_per_process"] = round(r["cpu_s"] / wall / r["processes"], 4)
        r["cpu_s"] = round(r["cpu_s"], 2)
    ttft = report.get("ttft") or {}
    return {"window_s": round(wall, 1), "cpu_s_total": round(sum(r["cpu_s"] for r in roles.values()), 2),
            "roles": roles, "throughput": report.get("throughput"), "failed": report.get("failed"),
            "ttft_mean": ttft.get("mean"), "ttft_p50": ttft.get("p50"), "ttft_p99": ttft.get("p99")}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(out["modes"])
    roles = sorted({r for m in modes for r in out["modes"][m]["roles"]})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    w = 0.8 / len(modes)
    for i, m in enumerate(modes):
        vals = [out["modes"][m]["roles"].get(r, {}).get("cores_per_process", 0.0) * 100 for r in roles]
        axes[0].bar([x + i * w for x in range(len(roles))], vals, w, label=m)
        t = out["modes"][m]
        axes[1].bar([x + i * w for x in range(3)], [t["ttft_p50"] or 0, t["ttft_mean"] or 0, t["ttft_p99"] or 0], w,
                    label=m)
    axes[0].set_xticks([x + w / 2 for x in range(len(roles))], roles, rotation=15, fontsize=8)
    axes[0].set(ylabel="% of a core per process, under load", title="CPU by role")
    axes[1].set_xticks([x + w / 2 for x in range(3)], ["TTFT p50", "TTFT mean", "TTFT p99"])
    axes[1].set(ylabel="seconds", title=f"easerve bench, {out['rate']} req/s x {out['requests']}")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"partition tenants: polling vs woken ({out['encode_pods']} encode pods, every prefill local; CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def summary(files: list[Path], path: Path) -> dict[str, Any]:
    """The committed runs side by side: woken over polling per run (CPU, TTFT mean and p99), plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for f in files:
        d = json.loads(f.read_text())
        runs.append({"file": f.name, "order": d.get("order", list(MODES)), **d["ratios_woken_over_polling"]})
    keys = ("cpu_total", "partner_cpu", "ttft_mean", "ttft_p99")
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        ax.bar([x + i * w for x in range(len(keys))], [r[k] or 0 for k in keys], w,
               label=f"{r['file'].removesuffix('.json')} ({r['order'][0]} first)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([x + w * (len(runs) - 1) / 2 for x in range(len(keys))], keys)
    ax.set(ylabel="woken / polling", title="partition tenants woken vs polling, run by run (CPU, sim engine)")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")
    return {"bench": "partition_wakeups", "mode": "summary", "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--encode", type=int, default=6, help="encode pods (each with a local prefill)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--woken-first", action="store_true", help="run the woken tenants first (order effects)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "partition_wakeups.png"))
    ap.add_argument("--summary", action="store_true", help="plot the committed runs (no serving)")
    args = ap.parse_args()
    if args.summary:
        files = sorted((REPO / "benchmarks" / "results").glob("partition_wakeups_cpu_run*.json"))
        print(json.dumps(summary(files, Path(args.plot)), indent=1))
        return 0
    work = Path(tempfile.mkdtemp(prefix="pw-spec-"))
    spec = spec_file(work, args.encode)
    out: dict[str, Any] = {"bench": "partition_wakeups", "measured": "cpu (this host)", "encode_pods": args.encode,
                           "rate": args.rate, "requests": args.requests, "seed": args.seed, "cores": os.cpu_count(),
                           "modes": {}}
    order = list(MODES)[::-1] if args.woken_first else list(MODES)
    out["order"] = order
    for name in order:
        env = MODES[name]
        out["modes"][name] = run_mode(name, env, spec, args.port, args.rate, args.requests, args.seed)
        log(f"{name}: {json.dumps(out['modes'][name])}")
    a, b = (out["modes"][m] for m in MODES)
    part = "local prefill (partner)"
    out["ratios_woken_over_polling"] = {
        "cpu_total": round(b["cpu_s_total"] / a["cpu_s_total"], 3) if a["cpu_s_total"] else None,
        "partner_cpu": round(b["roles"][part]["cpu_s"] / a["roles"][part]["cpu_s"], 3)
        if a["roles"].get(part, {}).get("cpu_s") else None,
        "ttft_mean": round(b["ttft_mean"] / a["ttft_mean"], 3) if a["ttft_mean"] else None,
        "ttft_p99": round(b["ttft_p99"] / a["ttft_p99"], 3) if a["ttft_p99"] else None,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    plot(out, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
