"""Online adaptation on the twin: goodput over drifting traffic, fixed configurations vs autopilot.

For a step trace (1 -> 4 -> 2 req/s by default) and a diurnal-shaped trace, the same requests are
replayed three times through the twin at the spec's allocation:

  (a) ``first_rate``: B and s tuned (twin grid) for the trace's first rate, fixed;
  (b) ``mean_rate``:  B and s tuned for the trace's time-averaged rate, fixed;
  (c) ``autopilot``:  starts as (a); every ``--tick`` seconds of virtual time the autopilot core
      (``easerve_operator.tuning.adapt.Autopilot``) sees the arrival rate and the good fraction of
      the last ``--window`` seconds (what the operator reads from Prometheus) and may re-tune;
      its decisions reach the twin's encode workers through ``policies.knobs.apply_knobs``,
      the same call the live workers make when their ConfigMap changes.

The re-tuner is the twin itself: a grid over B x s at the observed rate (quantised to
``--rate-step`` so decisions at nearby rates share runs), ranked by goodput at the objective tier,
within 1 % by mean TTFT. Goodput is over the whole trace: good requests / (first arrival to last
completion). ``--json`` prints ``{"step": {"first_rate": ..., "mean_rate": ..., "autopilot": ...},
"diurnal": {...}}`` (goodput at the objective tier, req/s) plus details; PNG plots of rate, B, s
and goodput over time go to ``--plot-dir``.

``--cluster`` adds the same three on the local cluster (``cluster_case``): a local control plane
whose pods run as processes (sim engine, ``--cluster-speedup`` times faster than modelled), a real
Prometheus, the operator; each configuration is deployed as an EPDDeployment and the trace is sent
through its frontend Service: (a) and (b) with B and s written in the spec, (c) with B and s left to
the operator (its twin search for the first rate, then its autopilot reading Prometheus and changing
the knobs live through the ConfigMap); (a) runs the knobs (c) started from (the operator's search
for the first rate), (b) the twin grid's for the mean rate. The trace is compressed by the speed-up and every figure is
mapped back to the model's time. So that one run stays within minutes, ``--cluster`` shortens the
traces (``--cluster-segment``, ``--cluster-period``) and the autopilot's timings, and runs the twin
part on those same traces: the two parts are side by side, request for request.

    python benchmarks/adapt.py --json
    python benchmarks/adapt.py -f examples/qwen2.5-vl-32b.yaml --json
    python benchmarks/adapt.py -f examples/qwen2.5-vl-32b.yaml --layout-ratio 0.7 --cluster --json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from easerve_operator.tuning.adapt import AdaptParams, Autopilot, Knobs, grid_retuner, twin_evaluator
from easerve_runtime.api import EPDDeploymentSpec, load_manifest
from easerve_runtime.policies.knobs import KnobChange
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.stages import Job
from easerve_runtime.sim.twin import Control, run_pipeline
from easerve_runtime.workload.generate import generate
from easerve_runtime.workload.metrics import is_good, summarize
from easerve_runtime.workload.request import Request

RateFn = Callable[[float], float]


def step_trace(rates: Sequence[float], seg_s: float) -> tuple[RateFn, float]:
    def rate(t: float) -> float:
        return rates[min(int(t // seg_s), len(rates) - 1)]

    return rate, seg_s * len(rates)


def diurnal_trace(mean: float, amp: float, period_s: float) -> tuple[RateFn, float]:
    """A day compressed into ``period_s``: trough at the start and end, peak in the middle."""

    def rate(t: float) -> float:
        return mean * (1.0 - amp * math.cos(2.0 * math.pi * t / period_s))

    return rate, period_s


def arrivals(rate: RateFn, horizon: float, seed: int, dt: float = 0.5) -> list[float]:
    """A non-homogeneous Poisson process with intensity ``rate`` on [0, horizon): unit-rate
    Poisson points mapped through the inverse of the cumulative intensity."""
    grid = [0.0]
    ts = [0.0]
    t = 0.0
    while t < horizon:
        grid.append(grid[-1] + rate(t + dt / 2) * dt)
        t += dt
        ts.append(t)
    rng = random.Random(seed)
    out, u = [], 0.0
    while True:
        u += rng.expovariate(1.0)
        if u >= grid[-1]:
            return out
        i = bisect.bisect_right(grid, u) - 1
        frac = (u - grid[i]) / (grid[i + 1] - grid[i]) if grid[i + 1] > grid[i] else 0.0
        out.append(ts[i] + frac * dt)


def workload(spec: EPDDeploymentSpec, rate: RateFn, horizon: float, seed: int) -> list[Request]:
    times = arrivals(rate, horizon, seed)
    base = generate(spec, 1.0, len(times), seed)  # media and lengths from the deployment's workload
    return [
        r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "arrival_s": t})
        for r, t in zip(base, times, strict=True)
    ]


def with_knobs(spec: EPDDeploymentSpec, k: Knobs) -> EPDDeploymentSpec:
    return spec.model_copy(
        update={
            "encode": spec.encode.model_copy(update={"batch_bound": k.batch_bound}),
            "offload": spec.offload.model_copy(update={"ratio": k.offload_ratio}),
        }
    )


def change_for(spec: EPDDeploymentSpec, k: Knobs) -> KnobChange:
    return KnobChange(
        encode=spec.encode.model_copy(update={"batch_bound": k.batch_bound}), ratio=k.offload_ratio
    )


class Observer:
    """The twin's stand-in for the operator's Prometheus queries over the last ``window`` seconds:
    arrival rate (arrivals / window) and good fraction (good completions / arrivals)."""

    def __init__(self, spec: EPDDeploymentSpec, window: float) -> None:
        self.tier = spec.slo.tier(str(spec.slo.objective))
        self.window = window

    def __call__(self, now: float, jobs: Sequence[Job]) -> tuple[float, float | None]:
        lo = now - self.window
        arrived = sum(1 for j in jobs if lo < j.req.arrival_s <= now)
        good = sum(
            1
            for j in jobs
            if j.rec.finish_s is not None and lo < j.rec.finish_s <= now and is_good(j.rec, self.tier)
        )
        rate = arrived / self.window
        return rate, (min(1.0, good / arrived) if arrived else None)


def replay(
    spec: EPDDeploymentSpec,
    reqs: list[Request],
    start: Knobs,
    tick: float,
    observer: Observer,
    pilot: Autopilot | None,
) -> dict[str, Any]:
    series: list[dict[str, Any]] = []
    knobs = [start]

    def on_tick(now: float, jobs: Sequence[Job]) -> KnobChange | None:
        rate, good = observer(now, jobs)
        change = None
        if pilot is not None and now >= observer.window:
            d = pilot.observe(now, rate, good)
            if d is not None:
                knobs[0] = d.new
                change = change_for(spec, d.new)
        series.append(
            {
                "t": now,
                "rate": rate,
                "good_fraction": good,
                "B": knobs[0].batch_bound,
                "s": knobs[0].offload_ratio,
            }
        )
        return change

    jobs, stats = run_pipeline(
        with_knobs(spec, start), reqs, cached_model(spec), control=Control(tick, on_tick)
    )
    recs = [j.rec for j in jobs]
    summ = summarize(recs, spec.slo)
    tier = observer.tier
    # goodput per window by completion time, for the plot
    for row in series:
        lo = row["t"] - tick
        row["goodput"] = (
            sum(
                1 for r in recs if r.finish_s is not None and lo < r.finish_s <= row["t"] and is_good(r, tier)
            )
            / tick
        )
    return {
        "goodput": summ["goodput"][tier.name],
        "throughput": summ["throughput"],
        "completed": summ["completed"],
        "ttft_p99": summ["ttft_p99"],
        "knob_changes": stats["knob_changes"],
        "decisions": [d.to_dict() for d in pilot.decisions] if pilot is not None else [],
        "series": series,
    }


def run_case(
    name: str, spec: EPDDeploymentSpec, rate: RateFn, horizon: float, args: argparse.Namespace, ev: Any
) -> dict[str, Any]:
    reqs = workload(spec, rate, horizon, args.seed)
    first = rate(0.0)
    mean = len(reqs) / horizon
    q = args.rate_step
    cur = [Knobs(spec.encode.batch_bound, float(spec.offload.ratio))]
    grid = (tuple(args.batch_bounds), tuple(args.ratios))
    # (a) and (b) are tuned FOR a rate (as HAS does); the autopilot scores at the top of its band
    fixed = grid_retuner(ev, lambda: cur[0], *grid)
    base = grid_retuner(ev, lambda: cur[0], *grid, headroom=args.band)

    def quant(r: float) -> float:
        return max(q, round(r / q) * q)

    def retune(r: float, pinned: frozenset[str]) -> Any:
        return base(quant(r), pinned)

    ka = fixed(quant(first), frozenset()).knobs
    kb = fixed(quant(mean), frozenset()).knobs
    observer = Observer(spec, args.window)
    out: dict[str, Any] = {"first_rate_value": first, "mean_rate_value": mean, "requests": len(reqs)}
    out["first_rate"] = replay(spec, reqs, ka, args.tick, observer, None)
    out["mean_rate"] = replay(spec, reqs, kb, args.tick, observer, None)
    params = AdaptParams(
        band=args.band,
        hold_s=args.hold,
        min_interval_s=args.min_interval,
        guard_window_s=args.guard,
        rollback_tolerance=0.05,
    )

    def pilot_retune(r: float, pinned: frozenset[str]) -> Any:
        cur[0] = pilot.knobs
        return retune(r, pinned)

    pilot = Autopilot(params, ka, first, pilot_retune)
    out["autopilot"] = replay(spec, reqs, ka, args.tick, observer, pilot)
    out["knobs"] = {"first_rate": vars_k(ka), "mean_rate": vars_k(kb)}
    return out


def _cluster_manifest(path: str, spec: EPDDeploymentSpec, knobs: Knobs | None, first: float,
                      args: argparse.Namespace, prometheus: str) -> dict[str, Any]:
    """(a)/(b): B and s written; (c): left to the operator, its search for ``first`` and its autopilot."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    sp = doc["spec"]
    sp["allocation"] = spec.allocation.wire()
    sp["smPartition"] = spec.sm_partition.wire()
    sp["observability"] = {"prometheusUrl": prometheus}
    k = args.cluster_speedup
    sp["pod"] = {"env": [{"name": "EASERVE_SIM_SPEEDUP", "value": f"{k:g}"},
                         {"name": "EASERVE_SIM_BYTES_SCALE", "value": "0.01"}]}
    if knobs is not None:
        sp["encode"]["batchBound"] = knobs.batch_bound
        sp["offload"] = {"ratio": knobs.offload_ratio}
        sp["tuning"] = {"enabled": False, "targetRate": first}
    else:
        sp["encode"].pop("batchBound", None)
        sp.pop("offload", None)
        sp["tuning"] = {"enabled": True, "targetRate": first, "trials": "twin", "trialBudget": 6,
                        "requestsPerTrial": 200,
                        "adapt": {"enabled": True, "band": args.band, "holdSeconds": args.hold / k,
                                  "minIntervalSeconds": args.min_interval / k, "guardWindowSeconds": args.guard / k}}
    return dict(doc)


def cluster_case(c: Any, path: str, spec: EPDDeploymentSpec, reqs: list[Request], knobs: dict[str, Knobs],
                 first: float, args: argparse.Namespace) -> dict[str, Any]:
    """The three configurations on the local cluster, one after the other, the same requests each."""
    import dataclasses

    import yaml
    from conftest import send_load  # tests/cluster/conftest.py: open-loop load through a Service

    k = args.cluster_speedup
    tier = spec.slo.tier(str(spec.slo.objective))
    real = [dataclasses.replace(r, arrival_s=r.arrival_s / k) for r in reqs]
    out: dict[str, Any] = {}
    knobs = dict(knobs)
    for label in ("autopilot", "first_rate", "mean_rate"):  # (a) runs what (c) started from
        ns = c.namespace()
        doc = _cluster_manifest(path, spec, knobs.get(label), first, args, c.prometheus_url)
        name = doc["metadata"]["name"]
        r = c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            st = c.epd(ns, name).get("status") or {}
            tu = st.get("tuning") or {}
            if st.get("phase") == "Ready" and (label != "autopilot" or tu.get("phase") == "Ready"):
                break
            time.sleep(1)
        c.wait_ready(ns, name, timeout=180)
        start = c.epd(ns, name)["status"]["effective"]
        t0 = time.time()
        outcomes = send_load(c.frontend_url(ns, name), Path(path), n=len(real), rate=0, reqs=real, timeout_s=300)
        time.sleep(3)
        st = c.epd(ns, name).get("status") or {}
        recs = []
        for o in outcomes:  # back to the model's time
            rec = o.record
            recs.append(dataclasses.replace(
                rec, arrival_s=rec.arrival_s * k,
                first_token_s=None if rec.first_token_s is None else rec.first_token_s * k,
                finish_s=None if rec.finish_s is None else rec.finish_s * k))
        good = sum(1 for x in recs if is_good(x, tier))
        ends = [x.finish_s for x in recs if x.finish_s is not None]
        span = (max(ends) - min(x.arrival_s for x in recs)) if ends else 0.0
        adapt = st.get("adapt") or {}
        decisions = adapt.get("decisions", [])
        out[label] = {
            "goodput": good / span if span > 0 else 0.0,
            "completed": sum(1 for x in recs if x.ok),
            "failed": sum(1 for x in recs if not x.ok),
            "start": {"B": start["batchBound"], "s": start["offloadRatio"]},
            "decisions": decisions,
            "calibration": adapt.get("calibration"),
            "wall_s": round(time.time() - t0, 1),
            "series": cluster_series(recs, tier, decisions, start, t0, k, span),
        }
        c.delete_namespace_and_wait(ns)
        if label == "autopilot":
            knobs["first_rate"] = Knobs(int(start["batchBound"]), float(start["offloadRatio"]))
    return out


def cluster_series(recs: list[Any], tier: Any, decisions: list[dict[str, Any]], start: dict[str, Any],
                   t0: float, k: float, span: float, window: float = 10.0) -> list[dict[str, Any]]:
    """Rate, goodput and the knobs in force per ``window`` of model time (decisions at their times)."""
    import datetime

    changes = []
    for d in decisions:
        at = datetime.datetime.strptime(d["at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
        changes.append(((at - t0) * k, d["new"]))
    out, t = [], window
    knobs = {"batchBound": start["batchBound"], "offloadRatio": start["offloadRatio"]}
    while t <= span + window:
        for when, new in changes:
            if when <= t:
                knobs = new
        arrived = sum(1 for r in recs if t - window < r.arrival_s <= t)
        good = sum(1 for r in recs if r.finish_s is not None and t - window < r.finish_s <= t and is_good(r, tier))
        out.append({"t": t, "rate": arrived / window, "goodput": good / window,
                    "B": knobs["batchBound"], "s": knobs["offloadRatio"]})
        t += window
    return out


def plot_cluster(name: str, res: dict[str, Any], path: Path) -> None:
    plot(name, res, path, title=f"autopilot on the local cluster (measured, sim pods): {name} trace",
         rate_label="offered rate (client)", xlabel="time (s, model time)")


def vars_k(k: Knobs) -> dict[str, Any]:
    return {"B": k.batch_bound, "s": k.offload_ratio}


def plot(name: str, res: dict[str, Any], path: Path, *, title: str | None = None,
         rate_label: str = "observed rate", xlabel: str = "virtual time (s)") -> None:
    """Rate, B, s and goodput over time of the three configurations (the twin's run by default)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    for label in ("first_rate", "mean_rate", "autopilot"):
        s = res[label]["series"]
        t = [r["t"] for r in s]
        if label == "autopilot":
            ax[0].plot(t, [r["rate"] for r in s], color="black", label=rate_label)
        ax[1].step(t, [r["B"] for r in s], where="post", label=label)
        ax[2].step(t, [r["s"] for r in s], where="post", label=label)
        ax[3].plot(t, [r["goodput"] for r in s], label=f"{label} ({res[label]['goodput']:.3f} req/s)")
    for a, y in zip(ax, ("arrival rate (req/s)", "B", "s", "goodput (req/s)"), strict=True):
        a.set_ylabel(y)
        a.legend(fontsize=7)
    ax[3].set_xlabel(xlabel)
    fig.suptitle(title or f"autopilot on the twin: {name} trace")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-f", "--file", default="examples/llava-v1.6-34b.yaml")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cluster", action="store_true", help="also run on the local cluster (see the docstring)")
    p.add_argument("--cluster-speedup", type=float, default=2.0, help="the sim pods' speed-up with --cluster")
    p.add_argument("--cluster-segment", type=float, default=80.0, help="seconds per step with --cluster (model time)")
    p.add_argument("--cluster-period", type=float, default=240.0, help="diurnal period with --cluster (model time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=float, nargs="+", default=[1.0, 4.0, 2.0])
    p.add_argument("--segment", type=float, default=300.0, help="seconds per step")
    p.add_argument("--diurnal-mean", type=float, default=2.0)
    p.add_argument("--diurnal-amp", type=float, default=0.6)
    p.add_argument("--diurnal-period", type=float, default=1200.0)
    p.add_argument("--tick", type=float, default=5.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--band", type=float, default=0.3)
    p.add_argument("--hold", type=float, default=20.0)
    p.add_argument("--min-interval", type=float, default=60.0)
    p.add_argument("--guard", type=float, default=40.0)
    p.add_argument("--rate-step", type=float, default=0.25)
    p.add_argument("--batch-bounds", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.25, 0.4, 0.5, 0.6, 0.75, 1.0])
    p.add_argument("--tune-requests", type=int, default=500)
    p.add_argument(
        "--layout-ratio",
        type=float,
        default=None,
        help="run the spec with this offload.ratio (a layout with local prefill when < 1; s can then move live)",
    )
    p.add_argument("--plot-dir", default="docs/img")
    args = p.parse_args(argv)
    t0 = time.process_time()
    _, spec = load_manifest(args.file)
    if args.layout_ratio is not None:
        spec = spec.model_copy(
            update={"offload": spec.offload.model_copy(update={"ratio": args.layout_ratio})}
        )
        if args.layout_ratio < 1 and str(spec.sm_partition.mode) == "none":
            spec = spec.model_copy(
                update={"sm_partition": spec.sm_partition.model_copy(update={"mode": "dynamic"})}
            )
    if not spec.has_local_prefill:
        print("adapt.py: the spec has no local prefill (s = 1): only B can change live", file=sys.stderr)
        args.ratios = [1.0]
    tier = str(spec.slo.objective)
    if args.cluster:  # shorter traces, so that the cluster part runs in minutes; the twin runs the same
        args.segment, args.diurnal_period = args.cluster_segment, args.cluster_period
        args.window, args.hold, args.min_interval, args.guard = 16.0, 16.0, 30.0, 20.0
    ev = twin_evaluator(spec, tier, requests=args.tune_requests, seed=args.seed)
    out: dict[str, Any] = {}
    details: dict[str, Any] = {}
    cases = {
        "step": step_trace(args.steps, args.segment),
        "diurnal": diurnal_trace(args.diurnal_mean, args.diurnal_amp, args.diurnal_period),
    }
    Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
    stem = Path(args.file).stem + ("" if args.layout_ratio is None else f"_s{args.layout_ratio:g}")
    cluster = None
    if args.cluster:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
        from conftest import running_pods_cluster

        cluster = running_pods_cluster()
        c = cluster.__enter__()
    for name, (rate, horizon) in cases.items():
        res = run_case(name, spec, rate, horizon, args, ev)
        if cluster is not None:
            knobs = {"first_rate": Knobs(res["knobs"]["first_rate"]["B"], res["knobs"]["first_rate"]["s"]),
                     "mean_rate": Knobs(res["knobs"]["mean_rate"]["B"], res["knobs"]["mean_rate"]["s"])}
            cres = cluster_case(c, args.file, spec, workload(spec, rate, horizon, args.seed), knobs, rate(0.0), args)
            plot_cluster(name, cres, Path(args.plot_dir) / f"adapt_cluster_{stem}_{name}.png")
            cg = {k: cres[k]["goodput"] for k in ("first_rate", "mean_rate", "autopilot")}
            out.setdefault("cluster", {})[name] = cg | {
                "autopilot/first_rate": cg["autopilot"] / cg["first_rate"] if cg["first_rate"] else None,
                "autopilot/mean_rate": cg["autopilot"] / cg["mean_rate"] if cg["mean_rate"] else None,
                "details": cres,
            }
        plot(name, res, Path(args.plot_dir) / f"adapt_{stem}_{name}.png")
        g = {k: res[k]["goodput"] for k in ("first_rate", "mean_rate", "autopilot")}
        out[name] = g | {
            "autopilot/first_rate": g["autopilot"] / g["first_rate"] if g["first_rate"] else None,
            "autopilot/mean_rate": g["autopilot"] / g["mean_rate"] if g["mean_rate"] else None,
        }
        details[name] = {
            "requests": res["requests"],
            "first_rate_value": res["first_rate_value"],
            "mean_rate_value": round(res["mean_rate_value"], 3),
            "knobs": res["knobs"],
            "decisions": res["autopilot"]["decisions"],
            "refused": [c for c in res["autopilot"]["knob_changes"] if c["refused"]],
            "ttft_p99": {k: res[k]["ttft_p99"] for k in ("first_rate", "mean_rate", "autopilot")},
        }
    out["details"] = details
    out["spec"] = args.file
    out["layout_ratio"] = args.layout_ratio
    out["tier"] = tier
    if cluster is not None:
        cluster.__exit__(None, None, None)
    out["cpu_s"] = round(time.process_time() - t0, 1)
    if args.json:
        print(json.dumps(out, default=float))
    else:
        for name in cases:
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()})
        for name, v in (out.get("cluster") or {}).items():
            print("cluster", name, {k: round(x, 3) if isinstance(x, float) else x for k, x in v.items() if k != "details"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
