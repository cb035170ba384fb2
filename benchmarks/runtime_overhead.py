"""Runtime overhead on this machine: policy decisions per request vs. one Dynamo round trip.

Issue 3's bar is "decisions <= 2 us per request". To put that number in context the same run
measures what a request pays anyway to cross one stage boundary: a Dynamo request round trip over
the TCP request plane (file discovery, loopback), serially and under concurrency, for a small
message and for an envelope-sized one.

- ``decisions``: per request, exactly what the encode worker does around the engine call:
  ``batcher.on_arrival`` + ``batcher.poll`` (the encoder is free at every arrival: worst case) +
  ``router.decide`` + a least-outstanding pick over 4 remote workers for REMOTE requests.
  One row per dispatch policy. Pure CPU, best and median of ``--repeats``.
- ``dynamo``: a Dynamo echo endpoint in a separate process; round trips of a 1 KB and a
  ``--envelope-kb`` message, serial (p50, mean) and at concurrency 16 (req/s).

    python benchmarks/runtime_overhead.py [--requests 200000] [--rtt-requests 300] [--out DIR]

Prints JSON; writes runtime_overhead.json and runtime_overhead.png to --out
(default benchmarks/out/runtime_overhead). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ECHO_SERVER = r"""
import asyncio, os, signal
from dynamo.runtime import DistributedRuntime
async def main():
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp")
    ep = rt.endpoint(os.environ["BENCH_ENDPOINT"])
    async def echo(req, context=None):
        yield {"n": len(req.get("blob", ""))}
    loop.add_signal_handler(signal.SIGTERM, rt.shutdown)
    rt.set_health_status(True)
    print("ready", flush=True)
    await ep.serve_endpoint(echo)
asyncio.run(main())
"""


def decisions(n: int, repeats: int, rate: float) -> dict[str, dict[str, float]]:
    from easerve_runtime.api import EncodeSpec
    from easerve_runtime.policies.batcher import make_batcher
    from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding, Route

    rng = random.Random(0)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    workers = [1, 2, 3, 4]
    out: dict[str, dict[str, float]] = {}
    for policy in ("poisson-gap", "fixed-timeout", "eager"):
        spec = EncodeSpec(dispatch=policy, batch_bound=8, max_age_ms=50)

        def once(spec: EncodeSpec = spec) -> float:
            b = make_batcher(spec)
            r = DeficitRouter(0.5)
            lo = LeastOutstanding()
            load = dict.fromkeys(workers, 0)
            arrive, poll, decide, pick = b.on_arrival, b.poll, r.decide, lo.pick
            t0 = time.perf_counter_ns()
            for i, now in enumerate(times):
                arrive(i, now)
                d = poll(now)
                if d is not None:
                    for _ in d.items:
                        if decide() == Route.REMOTE:
                            pick(workers, load)
            return (time.perf_counter_ns() - t0) / n / 1000

        per = [once() for _ in range(repeats)]
        out[policy] = {"best_us": round(min(per), 4), "median_us": round(statistics.median(per), 4)}
        print(f"  decisions[{policy}]: {min(per):.3f} us/request", file=sys.stderr)
    return out


async def _rtt(endpoint: str, n: int, envelope_kb: int) -> dict[str, Any]:
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    client = await rt.endpoint(endpoint).client()
    ids = await asyncio.wait_for(client.wait_for_instances(), 30)
    iid = ids[0]

    async def call(payload: dict[str, Any]) -> None:
        async for _ in await client.direct(payload, iid, annotated=False):
            pass

    res: dict[str, Any] = {}
    for label, size in (("1kb", 1024), (f"{envelope_kb}kb", envelope_kb * 1024)):
        payload = {"blob": "x" * size}
        for _ in range(20):  # warm up connections
            await call(payload)
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            await call(payload)
            lat.append((time.perf_counter() - t0) * 1e6)
            if i % 100 == 0:
                print(f"  rtt[{label}] {i}/{n}", file=sys.stderr)
        lat.sort()
        conc = 16
        t0 = time.perf_counter()
        per_task = max(1, n // conc)

        async def worker(payload: dict[str, Any] = payload, per_task: int = per_task) -> None:
            for _ in range(per_task):
                await call(payload)

        await asyncio.gather(*(worker() for _ in range(conc)))
        el = time.perf_counter() - t0
        res[label] = {
            "bytes": size,
            "serial_p50_us": round(lat[len(lat) // 2], 1),
            "serial_mean_us": round(statistics.fmean(lat), 1),
            "serial_p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
            "concurrency16_req_per_s": round(conc * per_task / el, 1),
        }
        print(f"  rtt[{label}]: p50 {res[label]['serial_p50_us']} us", file=sys.stderr)
    rt.shutdown()
    return res


def dynamo_rtt(n: int, envelope_kb: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="easerve-rtt-") as kv:
        env = dict(os.environ)
        env.update(
            {
                "DYN_FILE_KV": kv,
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                "DYN_LOG": "error",
                "DYN_TCP_MAX_MESSAGE_SIZE": str(512 * 1024 * 1024),
                "BENCH_ENDPOINT": f"rtt{os.getpid()}.echo.generate",
            }
        )
        env.pop("DYN_SYSTEM_PORT", None)
        server = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("echo server failed to start")
            os.environ.update(
                {
                    k: env[k]
                    for k in ("DYN_FILE_KV", "DYN_TCP_RPC_HOST", "DYN_LOG", "DYN_TCP_MAX_MESSAGE_SIZE")
                }
            )
            return asyncio.run(_rtt(env["BENCH_ENDPOINT"], n, envelope_kb))
        finally:
            server.terminate()
            server.wait(20)


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    d = report["decisions_us"]
    a.barh(list(d), [v["best_us"] for v in d.values()], color="tab:blue")
    a.axvline(2.0, color="tab:red", linestyle="--", label="bar 2 µs")
    a.set_xlabel("µs per request (batcher + router)")
    a.set_title("Policy decisions (CPU)")
    a.legend()
    r = report["dynamo_rtt"]
    labels = list(r)
    b.bar(labels, [r[k]["serial_p50_us"] for k in labels], color="tab:orange")
    b.set_ylabel("µs (serial p50)")
    b.set_title("Dynamo TCP round trip, loopback")
    for i, k in enumerate(labels):
        ratio = r[k]["serial_p50_us"] / d["poisson-gap"]["best_us"]
        b.annotate(f"{ratio:,.0f}× decisions", (i, r[k]["serial_p50_us"]), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(out / "runtime_overhead.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200_000, help="decisions: synthetic requests per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rate", type=float, default=200.0, help="arrival rate of the synthetic stream, req/s")
    ap.add_argument("--rtt-requests", type=int, default=300, help="Dynamo round trips per message size")
    ap.add_argument("--envelope-kb", type=int, default=1024, help="size of the envelope-like message, KB")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/runtime_overhead"))
    args = ap.parse_args()
    os.environ.setdefault("DYN_LOG", "error")  # before dynamo is imported: it logs every call at INFO
    print("decisions:", file=sys.stderr)
    dec = decisions(args.requests, args.repeats, args.rate)
    print("dynamo round trips:", file=sys.stderr)
    rtt = dynamo_rtt(args.rtt_requests, args.envelope_kb)
    best = dec["poisson-gap"]["best_us"]
    report = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "decisions_us": dec,
        "bar_us": 2.0,
        "meets_bar": {k: v["best_us"] <= 2.0 for k, v in dec.items()},
        "dynamo_rtt": rtt,
        "rtt_over_decisions": {k: round(v["serial_p50_us"] / best, 1) for k, v in rtt.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime_overhead.json").write_text(json.dumps(report, indent=2))
    try:
        plot(report, out)
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no plot", file=sys.stderr)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
