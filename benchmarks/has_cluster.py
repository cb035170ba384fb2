"""HAS run by the operator on the local cluster: time per phase, and each trial against the twin.

Runs the product's own entry point, ``easerve up --tune --json`` (local control plane, kubelet harness
running every pod as processes, a real Prometheus, the operator's search: profiling Jobs, trial
roll-outs, load Jobs, Prometheus scores, the best deployed and served), then reads its JSON line:

- **time** of the whole search and of each phase (profiling; per trial: roll-out, warm-up, measure,
  teardown), against the issue's bar: a 6-trial search of the LLaVA example under 10 minutes on 2
  cores (the sim engine's speed-up says how much faster than modelled the pods ran);
- **agreement** of every trial with the twin for the same candidate and requests
  (``tuning.agreement``: throughput within 5 %, P99 TTFT within 10 %, like with like), and of
  Prometheus with the load Job's own report (3 %);
- **the pick** against ``easerve tune --backend sim`` for the same spec (same allocation, goodput at
  the objective tier within 5 %);
- **the host's CPU** by role while each trial's load Job ran (``host_cpu.HostSampler``): which
  processes shared the two cores with the trial (``host_cpu_by_trial``; ``cores`` 2.0 is both busy).

Prints one JSON object; writes ``--out``/has_cluster.json and a PNG (per-trial throughput and P99
TTFT, cluster vs twin; the phases' time). ``--summary`` prints the committed results instead.

    python benchmarks/has_cluster.py --budget 6 --requests 100 --speedup 2 --out benchmarks/out
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


def run_up(budget: int, requests: int, speedup: float, rate: float) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, "-m", "easerve_operator.cli", "up", "--tune", "--json", "--tune-budget", str(budget),
           "--tune-requests", str(requests), "--sim-speedup", f"{speedup:g}", "--tune-rate", f"{rate:g}",
           "--requests", "20"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[easerve up]"):
            print(line.rstrip(), file=sys.stderr, flush=True)  # progress: phase, trial, ETA
        if line.startswith("{"):
            last = line
    proc.wait()
    if not last:
        raise SystemExit(f"easerve up --tune printed no JSON line (exit {proc.returncode})")
    return json.loads(last), time.monotonic() - t0


def sim_pick(budget: int, requests: int, rate: float) -> dict[str, Any]:
    """``easerve tune --backend sim`` for the same spec and budget (in-process)."""
    import yaml
    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.space import space_for
    from easerve_runtime.api import parse_spec

    raw = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])
    raw["tuning"]["targetRate"] = rate
    spec = parse_spec(raw)
    prof = SimStageProfiler(spec, rate=rate)
    res = tune(spec, runner=SimRunner(), profiler=prof, space=space_for(spec, prof.min_tp(),
               local_tp=prof.local_prefill_tp()), rate=rate, rules=StopRules(budget=budget), requests=requests)
    assert res.best is not None
    return {"allocation": res.best.allocation, "batchBound": res.best.batch_bound,
            "offloadRatio": res.best.offload_ratio, "metrics": res.best.metrics.to_dict(),
            "trials": [r.candidate.to_dict() for r in res.trials]}


def analyse(up: dict[str, Any], wall: float, pick: dict[str, Any], objective: str) -> dict[str, Any]:
    tu = up["tuning"]
    trials = [t for t in tu["trials"] if "agreement" in t]
    phases: dict[str, list[float]] = {}
    for t in trials:
        for k, v in (t["cluster"]["phasesS"] or {}).items():
            phases.setdefault(k, []).append(v)
    best = tu["best"]
    won = next((t for t in trials if t["candidate"].startswith(f"{best['allocation']} B={best['batchBound']} ")), None)
    cluster_good = (won or {}).get("cluster", {}).get("job", {}).get("goodput", {}).get(objective)
    started = tu.get("phase_started_s") or {}
    return {
        "wall_s": round(wall, 1),
        "ready_s": up.get("ready_s"),
        "search_s": round(started.get("Deploying", 0) - started.get("Profiling", 0), 1) if started else None,
        "profiling_s": round(started.get("Tuning", 0) - started.get("Profiling", 0), 1) if started else None,
        "phase_started_s": started,
        "per_trial_phase_s": {k: {"mean": round(sum(v) / len(v), 2), "max": round(max(v), 2)} for k, v in phases.items()},
        "sim_speedup": tu.get("sim_speedup"),
        "n_trials": tu.get("nTrials"),
        "stage1_sources": tu.get("stage1Sources"),
        "agreement": [{"trial": t["trial"], "candidate": t["candidate"], **t["agreement"],
                       # refused at the door: the load Job's failures against the twin's (sim.frontdoor)
                       "failed": {"cluster_job": t["cluster"]["job"].get("failed"), "twin": t["twin"].get("refused")},
                       "crosscheck": t["cluster"]["crosscheck"],
                       # each stage's busy time over its profile's (model time; 1.0 = as profiled)
                       "engine_over_profile": t.get("engineOverProfile")} for t in trials],
        "max_abs_err": {k: round(max(abs((t["agreement"][k] or 0) - 1) for t in trials), 4)
                        for k in ("throughput", "ttftP99", "ttftMean")} if trials else {},
        "pick": {"cluster": {k: best.get(k) for k in ("allocation", "batchBound", "offloadRatio")},
                 "sim": {k: pick[k] for k in ("allocation", "batchBound", "offloadRatio")},
                 "same_allocation": best.get("allocation") == pick["allocation"],
                 f"goodput@{objective}": {"cluster_job": cluster_good, "sim": pick["metrics"]["goodput"].get(objective)}},
        "load_after": {k: (up.get("load") or {}).get(k) for k in ("completed", "failed", "throughput")},
    }


def plot(res: dict[str, Any], up: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in up["tuning"]["trials"] if "agreement" in t]
    xs = [t["trial"] for t in trials]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot(xs, [t["twin"]["throughput"] for t in trials], "o--", label="twin (predicted)")
    ax[0].plot(xs, [t["cluster"]["job"]["throughput"] for t in trials], "s-", label="cluster (measured, load Job)")
    ax[0].set(title="throughput per trial", xlabel="trial", ylabel="req/s (model time)")
    ax[1].plot(xs, [t["twin"]["ttftP99Observed"] for t in trials], "o--", label="twin through the TTFT buckets")
    ax[1].plot(xs, [t["agreement"]["ttftP99"] * t["twin"]["ttftP99Observed"] for t in trials], "s-",
               label="cluster (Prometheus)")
    ax[1].set(title="P99 TTFT per trial", xlabel="trial", ylabel="s")
    for a in ax[:2]:
        a.legend(fontsize=8)
        a.set_xticks(xs)
    names = list(res["per_trial_phase_s"])
    ax[2].bar(names, [res["per_trial_phase_s"][n]["mean"] for n in names])
    ax[2].set(title="time per trial phase (mean)", ylabel="s (wall)")
    ax[2].tick_params(axis="x", rotation=30)
    fig.suptitle(f"HAS on the local cluster: {res['n_trials']} trials, sim engine x{res['sim_speedup']} "
                 f"(profiling {res['profiling_s']} s, search {res['search_s']} s, measured)")
    lo = min(min(t["twin"]["throughput"], t["cluster"]["job"]["throughput"]) for t in trials)
    hi = max(max(t["twin"]["throughput"], t["cluster"]["job"]["throughput"]) for t in trials)
    ax[0].set_ylim(lo * 0.9, hi * 1.1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def reagree(d: dict[str, Any], rate: float, requests: int) -> list[dict[str, Any]]:
    """A committed run's trials against the twin of the code checked out now (no cluster run).

    The cluster's whole-run figures are recovered from the recorded ratios and twin values (cluster
    = ratio x twin), then set against a fresh ``twin_prediction`` for the same candidate, rate,
    requests and seed. Why: a twin fix changes only the prediction side, and a 10-minute search
    would re-measure the cluster's side, which did not change, with new noise."""
    from easerve_operator.tuning.agreement import P99_TOLERANCE, THROUGHPUT_TOLERANCE, twin_prediction
    from easerve_operator.tuning.space import apply_candidate
    from easerve_runtime.api import load_manifest

    sys.path.insert(0, str(REPO / "benchmarks"))
    from trial_local import candidate

    base = load_manifest(str(EXAMPLE))[1]
    rows = []
    for t in d["up"]["tuning"]["trials"]:
        if "agreement" not in t:
            continue
        old, a = t["twin"], t["agreement"]
        live = {"throughput": a["throughput"] * old["throughput"], "ttftMean": a["ttftMean"] * old["ttftMean"],
                "ttftP99": a["ttftP99"] * old["ttftP99Observed"]}
        new = twin_prediction(apply_candidate(base, candidate(t["candidate"])), rate, requests, 1)
        r = {"throughput": live["throughput"] / new["throughput"], "ttftP99": live["ttftP99"] / new["ttftP99Observed"],
             "ttftMean": live["ttftMean"] / new["ttftMean"]}
        rows.append({"trial": t["trial"], "candidate": t["candidate"], "ratios": {k: round(v, 4) for k, v in r.items()},
                     "recorded_ratios": {k: round(v, 4) for k, v in a.items()},
                     "refused": {"cluster_job": t["cluster"]["job"].get("failed"), "twin": new["refused"],
                                 "twin_recorded": old.get("refused")},
                     "within": abs(r["throughput"] - 1) <= THROUGHPUT_TOLERANCE and abs(r["ttftP99"] - 1) <= P99_TOLERANCE})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--rate", type=float, default=2.0, help="the example's spec.tuning.targetRate")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    ap.add_argument("--summary", action="store_true", help="print the committed results/has_cluster*.json")
    ap.add_argument("--replot", type=Path, default=None, help="re-plot a has_cluster.json (no run)")
    ap.add_argument("--reagree", type=Path, default=None,
                    help="a has_cluster.json: its trials against the current code's twin (no run); --rate, --requests as run")
    args = ap.parse_args()
    if args.reagree is not None:
        print(json.dumps(reagree(json.loads(args.reagree.read_text()), args.rate, args.requests), indent=1))
        return 0
    if args.summary:
        docs = {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob("has_cluster*.json"))}
        # the searches' own files; the re-agreements beside them (--reagree's output) have no result
        out = {name: d["result"] for name, d in docs.items() if isinstance(d, dict) and "result" in d}
        print(json.dumps(out, indent=1))
        return 0
    if args.replot is not None:
        d = json.loads(args.replot.read_text())
        plot(d["result"], d["up"], args.replot.with_suffix(".png"))
        return 0
    from host_cpu import HostSampler

    with HostSampler() as host:
        up, wall = run_up(args.budget, args.requests, args.speedup, args.rate)
    pick = sim_pick(args.budget, args.requests, args.rate)
    res = analyse(up, wall, pick, "moderate")
    res["host_cpu_by_trial"] = host.by_trial()  # CPU seconds by role while each trial's load Job ran
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "has_cluster.json").write_text(json.dumps({"result": res, "up": up, "sim": pick}, indent=1))
    plot(res, up, args.out / "has_cluster.png")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
