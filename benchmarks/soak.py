"""Soak: a long run at 80 % of capacity; no failed request, and every process' RSS and open file
descriptors flat (the slope of a least-squares line through samples every ``--sample-s``).

    python benchmarks/soak.py [--spec examples/llava-v1.6-34b.yaml] [--minutes 30] [--speedup 10]
                              [--rate R] [--out benchmarks/out/soak]

``easerve serve`` runs the deployment on the sim engine; ``--speedup`` (EASERVE_SIM_SPEEDUP) compresses
its latencies, so the load is ``0.8 x speedup x`` the profile's saturation rate unless ``--rate``
says. The first ``--warmup-min`` minutes (allocator and import warm-up) are left out of the slopes.
Prints JSON and writes soak.json and soak.png (RSS and fds per process over time) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from easerve_runtime.api import load_manifest  # noqa: E402
from easerve_runtime.bench.load import Outcome, run_load  # noqa: E402
from easerve_runtime.profiles.capacity import saturation_rps  # noqa: E402
from easerve_runtime.workload import generate  # noqa: E402
from reliability import Serve, classify, pct  # noqa: E402


def proc_sample(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open fds) of ``pid``, None if it is gone."""
    try:
        rss_kb = next(
            int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:")
        )
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None
    return rss_kb / 1024.0, fds


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, y), per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "examples" / "llava-v1.6-34b.yaml"))
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=None, help="Requests/s (default 0.8 x capacity x speedup).")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warmup-min", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "soak"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, spec = load_manifest(args.spec)
    rate = args.rate or 0.8 * saturation_rps(spec) * args.speedup
    serve = Serve(args.spec, args.speedup, Path(tempfile.mkdtemp(prefix="easerve-soak-")) / "wd")
    procs = {f"{p['stage']}-{p['index']}": p["pid"] for p in serve.processes()}
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in procs}
    stop = threading.Event()
    t_start = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            now = time.monotonic() - t_start
            for name, pid in procs.items():
                s = proc_sample(pid)
                if s is not None:
                    samples[name].append((now, s[0], s[1]))
            stop.wait(args.sample_s)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    n = int(rate * args.minutes * 60)
    reqs = generate(spec, rate, n, 11)
    try:
        outs: list[Outcome]
        outs, duration = asyncio.run(run_load(serve.url, reqs, timeout_s=180.0))
    finally:
        stop.set()
        th.join()
        stop_s = serve.stop()
    kinds: dict[str, int] = {}
    for o in outs:
        kinds[classify(o)] = kinds.get(classify(o), 0) + 1
    ttft = [o.record.first_token_s - o.record.arrival_s for o in outs if o.record.ok and o.record.first_token_s]
    warm = args.warmup_min * 60
    per_proc: dict[str, Any] = {}
    for name, pts in samples.items():
        steady = [p for p in pts if p[0] >= warm] or pts
        per_proc[name] = {
            "samples": len(pts),
            "rss_mib_start": round(steady[0][1], 1) if steady else None,
            "rss_mib_end": round(steady[-1][1], 1) if steady else None,
            "rss_mib_per_min": _r(slope([(t, r) for t, r, _ in steady])),
            "fds_start": steady[0][2] if steady else None,
            "fds_end": steady[-1][2] if steady else None,
            "fds_per_min": _r(slope([(t, float(f)) for t, _, f in steady])),
            "series": [[round(t, 1), round(r, 1), f] for t, r, f in pts],  # (s, RSS MiB, fds)
        }
    errors: dict[str, int] = {}
    for o in outs:
        if not o.record.ok:
            errors[(o.record.error or "")[:100]] = errors.get((o.record.error or "")[:100], 0) + 1
    result = {
        "spec": args.spec,
        "minutes": args.minutes,
        "speedup": args.speedup,
        "rate_req_s": round(rate, 3),
        "sent": len(outs),
        "duration_s": round(duration, 1),
        **kinds,
        "failed": len(outs) - kinds.get("completed", 0),
        "errors": errors,
        "ttft_p50_s": _r(pct(ttft, 0.5)),
        "ttft_p99_s": _r(pct(ttft, 0.99)),
        "processes": per_proc,
        "serve_stop_after_sigterm_s": round(stop_s, 2),
        "load_avg_at_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
        for name, pts in samples.items():
            a.plot([t / 60 for t, _, _ in pts], [r for _, r, _ in pts], label=name)
            b.plot([t / 60 for t, _, _ in pts], [f for _, _, f in pts], label=name)
        a.set(xlabel="minutes", ylabel="RSS (MiB)", title="RSS per process")
        b.set(xlabel="minutes", ylabel="open fds", title="file descriptors per process")
        a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=110)
    except ImportError:
        pass
    return 0 if result["failed"] == 0 else 1


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


if __name__ == "__main__":
    sys.exit(main())
