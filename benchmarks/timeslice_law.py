"""How two processes share one GPU without MPS: a decode-like loop against prefill-like bursts
(issue 17 item 4; the twin's time-slicing term, ``sim/timeslice.py``).

Why: on one H200 every process of a served system time-slices the GPU, and the twin charges that
at dispatch, (1 + m)x for work dispatched while m other pods are busy. Run 12 served the pick at
5.5 req/s with decode iterations of 23.1 ms (1.94x the profiled 11.9 ms) while the twin timed
20.6 ms per token, and first tokens 20 % sooner than the twin said: the GPU does not split its time
the way the rule assumes. This measures the law directly, with two processes and no model:

- ``decode``: a CUDA graph of memory-bound matmuls (16 rows against 117 MB weights, ~330
  kernels, the profiled 7B step's length), then a host pause (the decode loop's sampling and
  bookkeeping), back to back, as the decode worker runs;
- ``prefill``: eager compute-bound matmuls (1,700 rows, a 7B prefill's length), one job at a
  time, jobs arriving as a Poisson stream whose alone-duty is ``f``.

Each runs alone, then together at several ``f``; the result is each side's dilation (its time
together over its time alone) against ``f``, beside what the twin's rule (``TimeSlicing``) and
plain processor sharing predict for the same streams. Prints one JSON object, writes ``--out``.

    python3 benchmarks/timeslice_law.py --out $OUT/timeslice.json             # GPU machine, ~2 min
    python benchmarks/timeslice_law.py --plot benchmarks/results/timeslice_law_h200_run13.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DECODE_ROWS, PREFILL_ROWS, HIDDEN, FFN = 16, 1700, 4096, 14336
DECODE_STEP_MS, DECODE_HOST_MS, PREFILL_MS = 9.9, 2.0, 65.0
DUTIES = (0.2, 0.4, 0.6, 0.8, 1.0)


# ------------------------------------------------------------------ the GPU half: one role per process
def calibrate(fn: Any, target_ms: float, per_unit: int) -> int:
    """Units of work (kernels) that take ``target_ms`` alone, from a timed run of ``per_unit``."""
    import torch

    fn(per_unit)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(per_unit)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    return max(1, round(per_unit * target_ms / ms))


def role(kind: str, units: int, seconds: float, duty: float, start_at: float, seed: int) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    weights = [torch.randn(HIDDEN, FFN, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(8)]
    rows = DECODE_ROWS if kind == "decode" else PREFILL_ROWS
    x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)

    def work(n: int) -> None:
        for i in range(n):
            torch.matmul(x, weights[i % len(weights)])

    target = DECODE_STEP_MS if kind == "decode" else PREFILL_MS
    if units <= 0:
        units = calibrate(work, target, 64 if kind == "decode" else 16)
    replay = lambda: work(units)  # noqa: E731
    if kind == "decode":  # the decode worker replays a captured graph
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            work(units)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work(units)
        replay = graph.replay
    replay()
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.005)
    rng = random.Random(seed)
    end = time.perf_counter() + seconds
    samples: list[float] = []
    waits: list[float] = []
    if kind == "decode":
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            replay()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3)
            spin = time.perf_counter() + DECODE_HOST_MS / 1e3  # the host's share of an iteration
            while time.perf_counter() < spin:
                pass
    else:
        gap = PREFILL_MS / 1e3 / duty
        nxt = time.perf_counter() + (rng.expovariate(1 / gap) if duty < 1 else 0.0)
        while nxt < end and time.perf_counter() < end:  # a backlog past the window would run alone
            now = time.perf_counter()
            if now < nxt:
                time.sleep(nxt - now)
            t0 = time.perf_counter()
            waits.append(max(0.0, (t0 - nxt) * 1e3))
            replay()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3)
            nxt = nxt + rng.expovariate(1 / gap) if duty < 1 else time.perf_counter()
    return {"kind": kind, "units": units, "n": len(samples), "ms_mean": statistics.fmean(samples) if samples else None,
            "ms_p50": statistics.median(samples) if samples else None,
            "wait_ms_mean": statistics.fmean(waits) if waits else None, "busy_s": sum(samples) / 1e3,
            "seconds": seconds}


def spawn(kind: str, units: int, seconds: float, duty: float, start_at: float, seed: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", kind, "--units", str(units), "--seconds", str(seconds),
           "--duty", str(duty), "--start-at", str(start_at), "--seed", str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"a role process failed ({p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def log(msg: str) -> None:
    print(f"[timeslice_law {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(seconds: float, duties: tuple[float, ...]) -> dict[str, Any]:
    lead = 20.0  # CUDA start, weights and graph capture before the shared window
    log("decode alone")
    dec = collect([spawn("decode", 0, seconds, 1.0, time.time() + lead, 1)])[0]
    log(f"decode alone: {dec['ms_mean']:.2f} ms a step ({dec['units']} kernels)")
    pre = collect([spawn("prefill", 0, seconds, 1.0, time.time() + lead, 2)])[0]
    log(f"prefill alone: {pre['ms_mean']:.2f} ms a job ({pre['units']} kernels)")
    points = []
    for i, f in enumerate(duties):
        t = time.time() + lead
        d, p = collect([spawn("decode", dec["units"], seconds, 1.0, t, 10 + i), spawn("prefill", pre["units"], seconds, f, t, 20 + i)])
        pt = {"duty": f, "decode_ms": d["ms_mean"], "prefill_ms": p["ms_mean"], "prefill_jobs": p["n"],
              "decode_dilation": d["ms_mean"] / dec["ms_mean"], "prefill_dilation": p["ms_mean"] / pre["ms_mean"],
              "prefill_busy_frac": p["busy_s"] / seconds, "decode_busy_frac": d["busy_s"] / seconds}
        log(f"f={f}: decode x{pt['decode_dilation']:.2f}, prefill x{pt['prefill_dilation']:.2f}")
        points.append(pt)
    return {"decode_alone": dec, "prefill_alone": pre, "points": points}


# ------------------------------------------------------------------ the twin half
def twin_rule(step_ms: float, host_ms: float, job_ms: float, duty: float, seconds: float, seed: int,
              host_dilated: bool = True, sharing: str = "dispatch") -> dict[str, float]:
    """The same two streams on the twin's rule (``sim.timeslice.TimeSlicing``: a dispatch pays
    1 + the other pods busy then) or, ``sharing="ps"``, on processor sharing (each busy side runs
    at half pace while the other is busy). Returns both sides' mean dilation."""
    from easerve_runtime.sim.timeslice import TimeSlicing

    if sharing == "ps":
        return _processor_sharing(step_ms, host_ms, job_ms, duty, seconds, seed)

    class Clock:
        now = 0.0

    clock = Clock()
    ts = TimeSlicing(clock, {"decode": frozenset({0}), "prefill": frozenset({0})})  # type: ignore[arg-type]
    rng = random.Random(seed)
    gap = job_ms / duty
    events: list[tuple[float, str]] = [(0.0, "decode"), (rng.expovariate(1 / gap) if duty < 1 else 0.0, "arrive")]
    queue: list[float] = []
    pre_busy_until = -1.0
    dec, pre = [], []
    while events:
        t, what = heapq.heappop(events)
        if t > seconds:
            break
        clock.now = t
        if what == "decode":
            k = ts.dilation("decode")
            gpu = step_ms * k
            host = host_ms * (k if host_dilated else 1.0)
            ts.occupy("decode", t + gpu + (host if host_dilated else 0.0))
            dec.append(gpu)
            heapq.heappush(events, (t + gpu + host, "decode"))
        elif what == "arrive":
            queue.append(t)
            heapq.heappush(events, (t + (rng.expovariate(1 / gap) if duty < 1 else job_ms), "arrive"))
            if pre_busy_until <= t:
                heapq.heappush(events, (t, "start"))
        elif what == "start" and queue and pre_busy_until <= t:
            queue.pop(0)
            d = job_ms * ts.dilation("prefill")
            ts.occupy("prefill", t + d)
            pre_busy_until = t + d
            pre.append(d)
            heapq.heappush(events, (t + d, "start"))
    return {"decode_dilation": statistics.fmean(dec) / step_ms, "prefill_dilation": statistics.fmean(pre) / job_ms}


def _processor_sharing(step_ms: float, host_ms: float, job_ms: float, duty: float, seconds: float,
                       seed: int) -> dict[str, float]:
    """Fluid processor sharing at 0.01 ms resolution: while both have GPU work each advances at half pace."""
    rng = random.Random(seed)
    gap = job_ms / duty
    dt, t = 0.01, 0.0
    arrivals = []
    a = rng.expovariate(1 / gap) if duty < 1 else 0.0
    while a < seconds:
        arrivals.append(a)
        a += rng.expovariate(1 / gap) if duty < 1 else job_ms
    d_left, d_host, d_start = step_ms, 0.0, 0.0
    p_left, p_start, qi = 0.0, 0.0, 0
    dec, pre = [], []
    while t < seconds:
        if p_left <= 0 and qi < len(arrivals) and arrivals[qi] <= t:
            p_left, p_start = job_ms, t
            qi += 1
        d_gpu = d_host <= 0
        both = d_gpu and p_left > 0
        rate = 0.5 if both else 1.0
        if d_gpu:
            d_left -= dt * rate
            if d_left <= 0:
                dec.append(t + dt - d_start)
                d_host, d_left = host_ms, step_ms
                if d_host <= 0:  # no host pause: the next step starts at once
                    d_start = t + dt
        else:
            d_host -= dt
            if d_host <= 0:
                d_start = t + dt
        if p_left > 0:
            p_left -= dt * rate
            if p_left <= 0:
                pre.append(t + dt - p_start)
        t += dt
    return {"decode_dilation": statistics.fmean(dec) / step_ms if dec else 1.0,
            "prefill_dilation": statistics.fmean(pre) / job_ms if pre else 1.0}


def with_predictions(run: dict[str, Any]) -> dict[str, Any]:
    step = run["decode_alone"]["ms_mean"]
    job = run["prefill_alone"]["ms_mean"]
    for i, pt in enumerate(run["points"]):
        secs = 20000.0
        pt["twin_rule"] = twin_rule(step, DECODE_HOST_MS, job, pt["duty"], secs, i)
        pt["processor_sharing"] = twin_rule(step, DECODE_HOST_MS, job, pt["duty"], 4000.0, i, sharing="ps")
    return run


def plot(run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = run["points"]
    f = [p["duty"] for p in pts]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, side in zip(axes, ("decode", "prefill"), strict=True):
        ax.plot(f, [p[f"{side}_dilation"] for p in pts], marker="o", label="GPU (measured)")
        ax.plot(f, [p["twin_rule"][f"{side}_dilation"] for p in pts], marker="x", ls="--", label="twin's rule (at dispatch)")
        ax.plot(f, [p["processor_sharing"][f"{side}_dilation"] for p in pts], marker="s", ls=":", label="processor sharing")
        ax.set(xlabel="prefill stream's duty alone", ylabel=f"{side} time together / alone", title=side)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"two processes time-slicing one {run.get('gpu', 'GPU')} (no MPS)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="GPU machine: write the run here")
    ap.add_argument("--seconds", type=float, default=8.0, help="each shared window")
    ap.add_argument("--plot", default=None, metavar="RUN_JSON", help="anywhere: redo the predictions and plot a run")
    ap.add_argument("--png", default=str(Path(__file__).resolve().parent.parent / "docs" / "img" / "timeslice_law.png"))
    ap.add_argument("--role", choices=["decode", "prefill"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--units", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--duty", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        print(json.dumps(role(args.role, args.units, args.seconds, args.duty, args.start_at, args.seed)), flush=True)
        return 0
    if args.plot:
        run = with_predictions(json.loads(Path(args.plot).read_text()))
        print(json.dumps(run, indent=1))
        plot(run, Path(args.png))
        return 0
    if not args.out:
        ap.error("--out (GPU machine) or --plot RUN_JSON")
    import torch

    run = {"bench": "timeslice_law", "measured": "gpu", "gpu": torch.cuda.get_device_name(0),
           "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "decode_host_ms": DECODE_HOST_MS,
           **measure(args.seconds, DUTIES)}
    run = with_predictions(run)
    Path(args.out).write_text(json.dumps(run, indent=1))
    print(json.dumps(run, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
