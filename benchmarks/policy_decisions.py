"""CPU cost of the pure runtime decisions, per request, in CPython (issue 3's bar: ≤ 2 µs).

Measures, side by side in one run:
- each batcher's per-request cost: ``on_arrival`` + a ``poll`` after every arrival (the worst
  case: an encoder that is always free polls on every arrival) + the amortised dispatch;
- the deficit router's ``decide`` and the least-outstanding pick over 4 remote workers;
- the sum "batcher + router" per request for each dispatch policy (the number the bar is about);
- for context: envelope packing throughput and the profile evaluations the twin calls per event.

    python benchmarks/policy_decisions.py [--requests 200000] [--repeats 5] [--out benchmarks/out/policy_decisions]

Prints JSON on stdout (best of ``--repeats``, and the median), progress on stderr, writes
policy_decisions.json and policy_decisions.png to --out. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _best_and_median(fn: Callable[[], int], repeats: int) -> tuple[float, float]:
    """(best, median) of CPU ns per operation; fn runs the loop and returns its op count.

    Thread CPU time, not wall time: on a shared machine a descheduled process would otherwise
    count other tenants' work as ours."""
    per = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        n = fn()
        per.append((time.thread_time_ns() - t0) / n)
    return min(per), statistics.median(per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rate", type=float, default=200.0, help="arrival rate of the synthetic stream, req/s")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/policy_decisions"))
    args = ap.parse_args()

    from easerve_runtime.policies.batcher import EagerBatcher, FixedTimeoutBatcher, PoissonGapBatcher
    from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding

    n = args.requests
    rng = random.Random(0)
    times = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(args.rate)
        times.append(t)
    items = list(range(n))
    results: dict[str, dict[str, float]] = {}

    def record(name: str, fn: Callable[[], int]) -> None:
        best, med = _best_and_median(fn, args.repeats)
        results[name] = {"best_us": round(best / 1000, 4), "median_us": round(med / 1000, 4)}
        print(f"  {name:38s} {best / 1000:7.3f} µs (median {med / 1000:.3f})", file=sys.stderr)

    makers = {
        "poisson-gap": lambda: PoissonGapBatcher(8, 0.050, 0.5, half_life_s=1.0),
        "fixed-timeout": lambda: FixedTimeoutBatcher(8, 0.010),
        "eager": lambda: EagerBatcher(8),
    }
    print(f"{n} requests, best of {args.repeats}:", file=sys.stderr)
    for name, make in makers.items():

        def run_batcher(make: Callable[[], PoissonGapBatcher] = make) -> int:  # type: ignore[assignment]
            b = make()
            arrive, poll = b.on_arrival, b.poll
            for i, now in zip(items, times, strict=True):
                arrive(i, now)
                poll(now)
            return n

        record(f"batcher[{name}]", run_batcher)

    def run_router() -> int:
        r = DeficitRouter(0.55)
        decide = r.decide
        for _ in range(n):
            decide()
        return n

    record("router.decide", run_router)

    workers = ["p0", "p1", "p2", "p3"]

    def run_pick() -> int:
        pick = LeastOutstanding().pick
        out = dict.fromkeys(workers, 0)
        for i in range(n):
            w = pick(workers, out)
            out[w] += 1
            if i % 3 == 0:
                out[w] -= 1
        return n

    record("least_outstanding.pick (4 workers)", run_pick)

    for name, make in makers.items():

        def run_all(make: Callable[[], PoissonGapBatcher] = make) -> int:  # type: ignore[assignment]
            b = make()
            r = DeficitRouter(0.55)
            lo = LeastOutstanding()
            out = dict.fromkeys(workers, 0)
            arrive, poll, decide, pick = b.on_arrival, b.poll, r.decide, lo.pick
            for i, now in zip(items, times, strict=True):
                arrive(i, now)
                d = poll(now)
                if d is not None:
                    for _ in d.items:
                        if decide() == "remote":
                            pick(workers, out)
            return n

        record(f"batcher+router[{name}]", run_all)

    # context: envelope packing and profile evaluation
    import numpy as np
    from easerve_runtime.policies.envelope import build_envelopes
    from easerve_runtime.profiles import load_profile

    embs = [np.ones((1899, 7168), dtype=np.float16) for _ in range(8)]
    nbytes = sum(e.nbytes for e in embs)

    def run_env() -> int:
        build_envelopes((f"r{i}", i % 2, e) for i, e in enumerate(embs))
        return 1

    best, med = _best_and_median(run_env, args.repeats)
    env = {"batch": 8, "bytes": nbytes, "best_ms": round(best / 1e6, 3), "gb_per_s": round(nbytes / best, 2)}
    print(f"  envelopes: 8 x 1899x7168 fp16 -> {env['best_ms']} ms ({env['gb_per_s']} GB/s)", file=sys.stderr)

    p = load_profile("llava-v1.6-34b@rtx6000ada")
    prof: dict[str, dict[str, float]] = {}
    for name, fn in {
        "encode_s (memoised)": lambda i: p.encode_s(1 + i % 32, 1.0),
        "prefill_s": lambda i: p.prefill_s(500 + i, 1.0, 2),
        "decode_step_s": lambda i: p.decode_step_s(1 + i % 64, 1000.0 + i, 2),
    }.items():
        m = 100_000

        def run_prof(fn: Callable[[int], float] = fn, m: int = m) -> int:
            for i in range(m):
                fn(i)
            return m

        best, med = _best_and_median(run_prof, args.repeats)
        prof[name] = {"best_us": round(best / 1000, 3), "median_us": round(med / 1000, 3)}
        print(f"  profile.{name:30s} {best / 1000:7.3f} µs", file=sys.stderr)

    report = {
        "python": sys.version.split()[0],
        "clock": "thread CPU time (time.thread_time_ns)",
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "requests": n,
        "rate": args.rate,
        "per_request_us": results,
        "bar_us": 2.0,
        "meets_bar": {k: v["best_us"] <= 2.0 for k, v in results.items() if k.startswith("batcher+router")},
        "envelope": env,
        "profile_call_us": prof,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_decisions.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(results)
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(names, [results[k]["best_us"] for k in names], color="tab:blue")
        ax.axvline(2.0, color="tab:red", linestyle="--", label="bar: 2 µs / request")
        ax.set_xlabel("CPU µs per request (best of repeats)")
        ax.set_title(f"Pure policy decisions, CPython {report['python']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "policy_decisions.png", dpi=120)
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no plot", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
