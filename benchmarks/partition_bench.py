"""SM partitioning on one GPU: knee table, carveout test, co-location ablation, sim calibration.

Runs ON the GPU machine and writes JSON + PNG to ``--out`` (default ``benchmarks/out``):

- ``partition_table_<encoder>.json``: the knee table (what ``easerve profile-partition`` writes);
- ``partition_knee.png``: CLIP latency vs SMs, default cuBLAS vs carveout;
- ``partition_ablation.png`` / ``partition_results.json``: the co-location ablation and all raw
  numbers (latency table, carveout decision, backend, extra encoders);
- ``partition_calibration.json``: SM-share slowdown curves for the twin's profiles;
- ``nvml_trace.json``: a memory-activity trace (idle / encoder / prefill / copy) for CPU fixtures.

Ablation: a Poisson stream of encode items (micro-batch = everything pending, up to B, so batch
sizes vary with the arrivals) shares the GPU with a local prefill (2048 tokens through 8
Llama-7B-shaped layers, one graph per layer so it can follow the partition at layer boundaries),
either closed-loop (always backlogged) or as a pipeline (a fraction ``--local-frac`` = 1 - s of
the requests prefill locally after their encode). Systems, side by side in one run: none (plain
streams), priority (plain streams, high-priority encode stream), static 50/50 green split,
dynamic per-micro-batch split from the knee table (the prefill takes the disjoint complement
while a micro-batch runs and the whole GPU between them), and dynamic with looser epsilons.

    PYTHONPATH=runtime python3 benchmarks/partition_bench.py --out $OUT            # all (~5 min on an H200)
    PYTHONPATH=runtime python3 benchmarks/partition_bench.py --quick --out $OUT    # smoke (~1.5 min)

The device image lacks pydantic (imported by ``easerve_runtime.policies``): install it from
wheels carried in ``.devwheels`` first (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from easerve_runtime.policies.partition import EncodeBatchSplit, PartitionTable  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --------------------------------------------------------------------------------------- knee
def knee(
    args: argparse.Namespace, torch: Any, pool: Any, res: dict[str, Any]
) -> tuple[PartitionTable, dict[int, bool], Any]:
    from easerve_runtime.engines.torch_encode import GraphedEncoder, build_encoder
    from easerve_runtime.partition.profiler import build_table, plot_curves, profile_latency, write_table

    enc = build_encoder(args.encoder)
    batches = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16]
    default = profile_latency(
        GraphedEncoder(enc), pool, args.levels, batches, carveout=False, reps=args.reps, progress=log
    )
    carve = None
    try:
        carve = profile_latency(
            GraphedEncoder(enc), pool, args.levels, batches, carveout=True, reps=args.reps, progress=log
        )
    except Exception as exc:
        res["carveoutError"] = repr(exc)
        log(f"carveout failed: {exc!r}")
    name = torch.cuda.get_device_properties(0).name
    table, use_carve = build_table(
        default, carve, pool.total_sms, args.epsilon, encoder=args.encoder, gpu=name, backend="green-context"
    )
    data = write_table(table, use_carve, args.out / f"partition_table_{args.encoder}.json")
    res["knee"] = {
        "defaultMs": {s: {b: round(t * 1e3, 3) for b, t in r.items()} for s, r in default.items()},
        "carveoutMs": {s: {b: round(t * 1e3, 3) for b, t in r.items()} for s, r in (carve or {}).items()},
        "table": data,
    }
    series = {"default": default}
    if carve:
        series["carveout"] = carve
    plot_curves(
        series, pool.total_sms, args.out / "partition_knee.png", f"{args.encoder} on {name}: latency vs SMs"
    )
    return table, use_carve, enc


# ------------------------------------------------------------------------------ other encoders
def other_encoders(args: argparse.Namespace, torch: Any, pool: Any, res: dict[str, Any]) -> None:
    from easerve_runtime.engines.torch_encode import GraphedEncoder, build_encoder
    from easerve_runtime.partition.profiler import time_replays

    out: dict[str, Any] = {}
    for name in ("whisper-large-v3", "qwen2-vl-vision"):
        try:
            enc = build_encoder(name)
            g = GraphedEncoder(enc, buckets=(1, 4))
            row: dict[str, Any] = {"graph": g.use_graphs}
            for sms in (pool.total_sms, 64):
                s = pool.primary(sms)
                for b in (1, 4):
                    row[f"{sms}sm_b{b}_ms"] = round(
                        time_replays(torch, lambda b=b, s=s, g=g: g.run(b, s), s, 5, 2) * 1e3, 3
                    )
            out[name] = row
            log(f"{name}: {row}")
            del g, enc
            torch.cuda.empty_cache()
        except Exception as exc:
            out[name] = {"error": repr(exc)[:400]}
            log(f"{name} failed: {exc!r}")
    res["otherEncoders"] = out


# ----------------------------------------------------------------------------------- ablation
class Prefill:
    """Local prefill on its own thread; the stream for each layer comes from ``choose(i)``.

    ``queue is None``: closed loop (always backlogged). Otherwise it pops request arrival times
    from ``queue`` (fed by the encode loop) and records each request's completion time.
    """

    def __init__(self, torch: Any, model: Any, queue: deque[float] | None = None) -> None:
        self.torch, self.model = torch, model
        self.queue = queue
        self.done = 0
        self.finished: list[tuple[float, float]] = []  # (arrival, finish) in run-relative seconds
        self.stop = False
        self.t0 = 0.0

    def loop(self, choose: Any) -> None:
        torch = self.torch
        prev_ev = None
        while not self.stop:
            arrival = None
            if self.queue is not None:
                if not self.queue:
                    time.sleep(50e-6)
                    continue
                arrival = self.queue.popleft()
            for i in range(self.model.shape.layers):
                s = choose(i)
                while s is None and not self.stop:  # partner has no SMs right now: wait
                    time.sleep(20e-6)
                    s = choose(i)
                if self.stop:
                    return
                if prev_ev is not None:
                    s.wait_event(prev_ev)
                self.model.run_layer(i, s)
                ev = torch.cuda.Event()
                ev.record(s)
                ev.synchronize()  # at most one layer in flight: the partition can move between layers
                prev_ev = ev
            self.done += 1
            if arrival is not None:
                self.finished.append((arrival, time.perf_counter() - self.t0))


def run_mode(
    mode: str,
    torch: Any,
    pool: Any,
    encg: Any,
    prefill: Any,
    split: EncodeBatchSplit,
    rate: float,
    seconds: float,
    bmax: int,
    seed: int,
    static_sms: int,
    local_frac: float | None = None,
) -> dict[str, Any]:
    """One system at one rate. ``local_frac=None``: closed-loop prefill; else each request's
    prefill runs locally with probability ``local_frac`` after its encode (the EPD pipeline)."""
    total = pool.total_sms
    state = {"enc_sms": 0}
    plain_enc = pool.high_priority if mode == "priority" else pool.full_primary
    plain_pre = pool.full_partner

    def enc_stream(n: int) -> tuple[Any, int]:
        if mode in ("none", "priority"):
            return plain_enc, total
        if mode == "static":
            return pool.primary(static_sms), static_sms
        sms = split.decide(n).primary_sms
        return pool.primary(sms), sms

    def choose(_i: int) -> Any:
        if mode in ("none", "priority"):
            return plain_pre
        if mode == "static":
            return pool.partner(static_sms)
        sms = state["enc_sms"]
        if sms <= 0:
            return plain_pre
        if sms >= total:
            return None
        return pool.partner(sms)

    rng = random.Random(seed)
    arrivals, local, t = [], [], 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append(t)
        local.append(local_frac is not None and rng.random() < local_frac)
    q: deque[float] | None = deque() if local_frac is not None else None
    pf = Prefill(torch, prefill, q)
    th = threading.Thread(target=pf.loop, args=(choose,), daemon=True)
    lat: list[float] = []
    remote_done: list[float] = []
    sizes: list[int] = []
    levels: dict[int, int] = {}
    if q is None:
        th.start()
        time.sleep(0.5)  # let the closed-loop prefill reach steady state
    done0 = pf.done
    t0 = time.perf_counter()
    pf.t0 = t0
    if q is not None:
        th.start()
    i = 0
    while i < len(arrivals):
        now = time.perf_counter() - t0
        if now > seconds:  # overloaded systems leave a backlog: it counts as not served
            break
        if arrivals[i] > now:
            time.sleep(max(0.0, arrivals[i] - now - 50e-6))
            continue
        j = i
        while j < len(arrivals) and arrivals[j] <= now and j - i < bmax:
            j += 1
        n = j - i
        s, sms = enc_stream(n)
        state["enc_sms"] = sms
        encg.run(n, s)
        ev = torch.cuda.Event()
        ev.record(s)
        ev.synchronize()
        state["enc_sms"] = 0
        fin = time.perf_counter() - t0
        for k in range(i, j):
            lat.append(fin - arrivals[k])
            if q is not None:
                if local[k]:
                    q.append(arrivals[k])
                else:
                    remote_done.append(fin - arrivals[k])
        sizes.append(n)
        levels[sms] = levels.get(sms, 0) + 1
        i = j
    elapsed = time.perf_counter() - t0
    prefills = pf.done - done0
    pf.stop = True
    th.join()
    torch.cuda.synchronize()
    out: dict[str, Any] = {
        "mode": mode,
        "rate": rate,
        "seconds": round(elapsed, 3),
        "items": len(lat),
        "arrived": len(arrivals),
        "encodeMeanMs": round(statistics.mean(lat) * 1e3, 3),
        "encodeP50Ms": round(pct(lat, 0.5) * 1e3, 3),
        "encodeP99Ms": round(pct(lat, 0.99) * 1e3, 3),
        "encodeItemsPerS": round(len(lat) / elapsed, 2),
        "meanMicroBatch": round(statistics.mean(sizes), 2),
        "microBatches": len(sizes),
        "levelUse": {str(k): v for k, v in sorted(levels.items())},
        "prefillPerS": round(prefills / elapsed, 3),
    }
    if q is not None:
        local_lat = [f - a for a, f in pf.finished]
        out["localFrac"] = local_frac
        out["localBacklogAtEnd"] = len(q)
        out["requestsPerS"] = round((len(remote_done) + len(local_lat)) / elapsed, 2)
        out["localTtftMeanMs"] = round(statistics.mean(local_lat) * 1e3, 2) if local_lat else None
        out["localTtftP99Ms"] = round(pct(local_lat, 0.99) * 1e3, 2) if local_lat else None
    return out


def ablation(
    args: argparse.Namespace,
    torch: Any,
    pool: Any,
    enc: Any,
    table: PartitionTable,
    use_carve: dict[int, bool],
    res: dict[str, Any],
) -> None:
    from easerve_runtime.engines.torch_encode import GraphedEncoder
    from easerve_runtime.engines.torch_prefill import LlamaPrefill
    from easerve_runtime.partition.profiler import set_carveout, time_replays

    total = pool.total_sms
    static_sms = args.static_sms
    tables = {"dynamic": table}
    if not args.quick:
        for eps in args.extra_epsilon:
            tables[f"dynamic-eps{eps:g}"] = PartitionTable.from_latencies(total, table.latency_s, epsilon=eps)
    buckets = tuple(b for b in (1, 2, 3, 4, 6, 8, 12, 16) if b <= args.bmax)
    encg = GraphedEncoder(enc, buckets=buckets)
    need = {total, static_sms}
    for t in tables.values():
        need |= {t.level_for(b).sms for b in buckets}
    log(f"ablation: encode levels {sorted(need)}; capturing graphs")
    carve_any = any(use_carve.values())
    for sms in sorted(need):
        streams = [pool.primary(sms)] + ([pool.high_priority] if sms == total else [])
        for s in streams:
            for b in buckets:
                if sms < total and use_carve.get(sms, carve_any):
                    set_carveout(torch, total - sms)
                try:
                    encg.capture(b, s)
                finally:
                    set_carveout(torch, None)
    prefill = LlamaPrefill(tokens=args.prefill_tokens)
    partner_streams: dict[Any, int | None] = {pool.full_partner: None}
    for sms in need:
        if 0 < sms < total:
            partner_streams[pool.partner(sms)] = total - sms
    for s, cut in partner_streams.items():
        if cut and carve_any:
            set_carveout(torch, cut)
        try:
            prefill.capture(s)
        finally:
            set_carveout(torch, None)
    # solo references (full GPU, nothing else running)
    s = pool.full_partner
    solo_prefill = time_replays(
        torch, lambda: [prefill.run_layer(i, s) for i in range(prefill.shape.layers)], s, 10, 2
    )
    solo_enc = {
        b: time_replays(torch, lambda b=b: encg.run(b, pool.full_primary), pool.full_primary, 10, 2)
        for b in buckets
    }
    enc_cap = max(b / t for b, t in solo_enc.items())  # items/s the encoder sustains alone, batched
    res["ablationSolo"] = {
        "prefillMs": round(solo_prefill * 1e3, 3),
        "prefillTflops": round(prefill.flops / solo_prefill / 1e12, 1),
        "encodeMs": {b: round(t * 1e3, 3) for b, t in solo_enc.items()},
        "encodeCapacityItemsPerS": round(enc_cap, 1),
    }
    log(f"solo: {res['ablationSolo']}")
    modes = ["none", "priority", "static", *tables]
    rows = []
    for variant, rates, local_frac in (
        ("closed-loop", args.rates, None),
        ("pipeline", args.pipeline_rates, args.local_frac),
    ):
        for rate in rates:
            for mode in modes:
                for rep in range(args.repeats):
                    split = EncodeBatchSplit(tables.get(mode, table))
                    r = run_mode(
                        "dynamic" if mode.startswith("dynamic") else mode,
                        torch,
                        pool,
                        encg,
                        prefill,
                        split,
                        rate,
                        args.seconds,
                        args.bmax,
                        args.seed + rep,
                        static_sms,
                        local_frac,
                    )
                    r["mode"], r["variant"], r["repeat"] = mode, variant, rep
                    # work-normalised throughput: each stream's rate over what it sustains alone
                    r["prefillShareOfSolo"] = round(r["prefillPerS"] * solo_prefill, 4)
                    r["encodeShareOfSolo"] = round(r["encodeItemsPerS"] / enc_cap, 4)
                    r["totalThroughput"] = round(r["prefillShareOfSolo"] + r["encodeShareOfSolo"], 4)
                    log(
                        f"{variant} rate {rate:5.0f} {mode:14s} enc mean {r['encodeMeanMs']:8.2f} p99 "
                        f"{r['encodeP99Ms']:8.2f} ms | prefill {r['prefillPerS']:6.2f}/s | total "
                        f"{r['totalThroughput']:.3f} | req/s {r.get('requestsPerS')} ttft p99 "
                        f"{r.get('localTtftP99Ms')} | levels {r['levelUse']}"
                    )
                    rows.append(r)
    res["ablation"] = {
        "staticSMs": static_sms,
        "bmax": args.bmax,
        "prefillTokens": args.prefill_tokens,
        "localFrac": args.local_frac,
        "rows": rows,
    }
    ratios: dict[str, Any] = {}
    for variant in ("closed-loop", "pipeline"):
        vrows = [r for r in rows if r["variant"] == variant]
        for rate in sorted({r["rate"] for r in vrows}):

            def avg(mode: str, key: str, rate: float = rate, vrows: list[dict[str, Any]] = vrows) -> float:
                xs = [
                    r[key]
                    for r in vrows
                    if r["rate"] == rate and r["mode"] == mode and r.get(key) is not None
                ]
                return statistics.mean(xs) if xs else float("nan")

            cmp = {}
            tput = "requestsPerS" if variant == "pipeline" else "totalThroughput"
            for base in ("none", "priority", "static"):
                cmp[f"dynamic_vs_{base}"] = {
                    "throughput": round(avg("dynamic", tput) / avg(base, tput) - 1, 4),
                    "encodeP99": round(avg("dynamic", "encodeP99Ms") / avg(base, "encodeP99Ms") - 1, 4),
                    "encodeMean": round(avg("dynamic", "encodeMeanMs") / avg(base, "encodeMeanMs") - 1, 4),
                }
                if variant == "pipeline":
                    cmp[f"dynamic_vs_{base}"]["localTtftP99"] = round(
                        avg("dynamic", "localTtftP99Ms") / avg(base, "localTtftP99Ms") - 1, 4
                    )
            ratios[f"{variant}@{rate:g}"] = cmp
            log(f"{variant} rate {rate}: {cmp}")
    res["ablation"]["ratios"] = ratios
    plot_ablation(rows, args.out / "partition_ablation.png")


def plot_ablation(rows: list[dict[str, Any]], path: Path) -> None:
    """Row 1: closed-loop prefill; row 2: the EPD pipeline. Bars average the repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "closed-loop": (
            ("encodeP99Ms", "encode P99 (ms)"),
            ("encodeMeanMs", "encode mean (ms)"),
            ("totalThroughput", "total throughput (share of solo)"),
        ),
        "pipeline": (
            ("encodeP99Ms", "encode P99 (ms)"),
            ("localTtftP99Ms", "local-prefill request P99 (ms)"),
            ("requestsPerS", "completed requests/s"),
        ),
    }
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    w = 0.8 / max(1, len(modes))
    for row_ax, (variant, keys) in zip(axes, panels.items(), strict=True):
        vrows = [r for r in rows if r.get("variant") == variant]
        rates = sorted({r["rate"] for r in vrows})
        for ax, (key, title) in zip(row_ax, keys, strict=True):
            for k, m in enumerate(modes):
                ys = []
                for rate in rates:
                    xs = [
                        r[key]
                        for r in vrows
                        if r["rate"] == rate and r["mode"] == m and r.get(key) is not None
                    ]
                    ys.append(statistics.mean(xs) if xs else 0.0)
                ax.bar([i + k * w for i in range(len(rates))], ys, w, label=m)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rates))], [f"{r:g}/s" for r in rates])
            ax.set_title(f"{variant}: {title}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
            if "P99" in title or "mean" in title:
                ax.set_yscale("log")
        row_ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------- calibration
def calibration(args: argparse.Namespace, torch: Any, pool: Any, res: dict[str, Any]) -> None:
    """Relative slowdown vs SM share for the encoder (from the knee) and the prefill workload."""
    from easerve_runtime.engines.torch_prefill import LlamaPrefill
    from easerve_runtime.partition.profiler import set_carveout, time_replays

    total = pool.total_sms
    knee_ms = res.get("knee", {}).get("table", {}).get("latencyMs", {})
    enc_curves: dict[str, list[list[float]]] = {}
    if knee_ms:
        full = knee_ms[str(total)]
        for b in full:
            enc_curves[b] = [
                [round(int(s) / total, 4), round(row[b] / full[b], 4)]
                for s, row in sorted(knee_ms.items(), key=lambda kv: int(kv[0]))
            ]
    pre = LlamaPrefill(tokens=args.prefill_tokens)
    pre_curve = []
    base = None
    for sms in sorted(set(args.levels) | {total}, reverse=True):
        s = pool.primary(sms)
        if sms < total:
            set_carveout(torch, total - sms)
        try:
            pre.capture(s)
        finally:
            set_carveout(torch, None)
        t = time_replays(torch, lambda s=s: [pre.run_layer(i, s) for i in range(pre.shape.layers)], s, 8, 2)
        base = base or t
        pre_curve.append([round(sms / total, 4), round(t / base, 4)])
        log(f"prefill {sms} SMs: {t * 1e3:.2f} ms")
    res["calibration"] = {
        "gpu": torch.cuda.get_device_properties(0).name,
        "totalSMs": total,
        "doc": "slowdown(share) = latency at share / latency at full GPU, measured with graphs on green-context "
        "streams (carveout where it helps). Interpolate linearly in share; below the smallest share extrapolate as 1/share.",
        "encodeSlowdown": {args.encoder: enc_curves},
        "prefillSlowdown": {f"llama7b-layer-x{pre.shape.layers}-{args.prefill_tokens}tok": pre_curve},
    }
    (args.out / "partition_calibration.json").write_text(json.dumps(res["calibration"], indent=1))


# ---------------------------------------------------------------------------------- NVML trace
def nvml_trace(args: argparse.Namespace, torch: Any, pool: Any, enc: Any, res: dict[str, Any]) -> None:
    from easerve_runtime.engines.torch_encode import GraphedEncoder
    from easerve_runtime.partition.nvml_signal import MemoryActivitySampler

    samples: list[dict[str, Any]] = []
    try:
        sm = MemoryActivitySampler(0, use_gpm=False)
        gpm = MemoryActivitySampler(0, use_gpm=True)
    except Exception as exc:
        res["nvmlError"] = repr(exc)
        return
    g = GraphedEncoder(enc, buckets=(8,))
    s = pool.full_primary
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t0 = time.monotonic()

    last_gpm = {"t": 0.0, "v": float("nan")}

    def phase(name: str, active: bool, seconds: float, work: Any) -> None:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while time.monotonic() < end:
            if work:
                work()
                torch.cuda.synchronize()
            now = time.monotonic()
            if now >= nxt:
                t1 = time.perf_counter()
                u = sm.sample()
                cost = time.perf_counter() - t1
                if now - last_gpm["t"] >= 0.1:  # GPM needs >= ~100 ms between samples
                    v = gpm.gpm_dram_bw() if gpm.gpm else None
                    last_gpm["t"], last_gpm["v"] = now, float("nan") if v is None else v
                samples.append(
                    {
                        "t": round(now - t0, 4),
                        "memory": u,
                        "gpmDramBw": round(last_gpm["v"], 2),
                        "downstreamActive": active,
                        "phase": name,
                        "sampleUs": round(cost * 1e6, 1),
                    }
                )
                nxt += 0.01
        torch.cuda.synchronize()

    phase("idle", False, 1.0, None)
    phase("encoder", False, 1.5, lambda: g.run(8, s))
    phase("copy", True, 1.5, lambda: y.copy_(x))
    phase("encoder+copy", True, 1.5, lambda: (g.run(8, s), y.copy_(x)))
    phase("idle", False, 1.0, None)
    trace = {
        "source": f"recorded on {torch.cuda.get_device_properties(0).name} by benchmarks/partition_bench.py",
        "periodS": 0.01,
        "gpmSupported": gpm.gpm,
        "samples": samples,
    }
    (args.out / "nvml_trace.json").write_text(json.dumps(trace))
    by: dict[str, list[float]] = {}
    for r in samples:
        by.setdefault(r["phase"], []).append(r["memory"])
    res["nvml"] = {k: round(statistics.mean(v), 1) for k, v in by.items()}
    res["nvmlSampleUs"] = round(statistics.median(r["sampleUs"] for r in samples), 1)
    log(f"nvml memory by phase: {res['nvml']}, sample {res['nvmlSampleUs']} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    ap.add_argument("--encoder", default="clip-vit-l-336")
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 32, 48, 64, 80, 96, 112, 128])
    ap.add_argument("--epsilon", type=float, default=0.1)
    ap.add_argument("--extra-epsilon", type=float, nargs="*", default=[0.3])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--rates", type=float, nargs="*", default=[300.0, 600.0], help="closed-loop encode items/s"
    )
    ap.add_argument(
        "--pipeline-rates", type=float, nargs="+", default=[120.0, 200.0], help="pipeline requests/s"
    )
    ap.add_argument("--local-frac", type=float, default=0.45, help="1 - s: share of prefills run locally")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--bmax", type=int, default=16)
    ap.add_argument("--static-sms", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", type=Path, default=None, help="reuse this knee table JSON (skips the knee)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--skip", nargs="*", default=[], help="sections to skip: knee others trace ablation calibration"
    )
    args = ap.parse_args()
    if args.quick:
        args.levels, args.reps, args.rates, args.seconds = [32, 64, 96, 128], 5, [400.0], 2.0
        args.pipeline_rates = [150.0]
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU: this benchmark runs on the GPU machine"}))
        return 2
    from easerve_runtime.partition.backends import GreenContextPool, detect_backend

    res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__}
    info = detect_backend("green-context")
    res["backend"] = info.__dict__
    log(f"backend {info}")
    t = time.perf_counter()
    levels = sorted(set(args.levels) | {args.static_sms})
    pool = GreenContextPool(levels)
    res["pool"] = pool.describe()
    res["poolCreateS"] = round(time.perf_counter() - t, 4)
    log(
        f"pool {res['pool']['mode']} disjoint={pool.disjoint} in {res['poolCreateS']} s: {res['pool']['levels']}"
    )
    table = use_carve = enc = None
    if args.table is not None:  # reuse a knee table measured earlier instead of profiling again
        from easerve_runtime.engines.torch_encode import build_encoder

        data = json.loads(args.table.read_text())
        table = PartitionTable.from_dict(data)
        use_carve = {int(k): bool(v) for k, v in data.get("carveout", {}).items()}
        enc = build_encoder(args.encoder)
        args.skip = [*args.skip, "knee"]
        res["tableFrom"] = str(args.table)
    sections = [s for s in ("knee", "trace", "ablation", "calibration", "others") if s not in args.skip]
    for sec in sections:
        t = time.perf_counter()
        try:
            if sec == "knee":
                table, use_carve, enc = knee(args, torch, pool, res)
            elif sec == "trace" and enc is not None:
                nvml_trace(args, torch, pool, enc, res)
            elif sec == "ablation" and table is not None:
                ablation(args, torch, pool, enc, table, use_carve or {}, res)
            elif sec == "calibration":
                calibration(args, torch, pool, res)
            elif sec == "others":
                other_encoders(args, torch, pool, res)
        except Exception as exc:
            res[f"{sec}Error"] = traceback.format_exc()[-2000:]
            log(f"section {sec} failed: {exc!r}")
        res.setdefault("sectionS", {})[sec] = round(time.perf_counter() - t, 1)
        (args.out / "partition_results.json").write_text(json.dumps(res, indent=1, default=str))
        torch.cuda.synchronize()
    summary = {k: res.get(k) for k in ("backend", "poolCreateS", "sectionS")}
    summary["ratios"] = res.get("ablation", {}).get("ratios")
    summary["errors"] = [k for k in res if k.endswith("Error")]
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
