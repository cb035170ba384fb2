"""HAS against the hardware (issue 17, item 5): HAS's pick on the calibrated twin, deployed on the
GPU, reaches at least 95 % of the best goodput found by the baselines' sweep plus HAS's own top 3.

Three modes:

- ``--plan`` (default; CPU): the project's HAS (``easerve_operator.tuning.search.tune``: Stage 1,
  then Stage 2 with Optuna, what ``easerve tune --backend sim`` runs) on the calibrated twin of
  the LLaVA-NeXT 7B that ``gpu_serve.py`` serves: the engine profile measured on the H200
  (``twin_agreement.PROFILE``), every pod on ONE host GPU (``host_gpus=1``: they time-slice it,
  ``sim/timeslice.py``), the bench's workload (the image workload's JPEG sizes, 300 requests, the
  bench's seed), gpu_serve's SLO tiers (``--slo-scale 4``), objective goodput at the moderate
  tier, at ``--rate`` req/s. Prints one JSON line: HAS's pick, its top 3 by twin goodput, the
  twin's prediction for each, and the ``gpu_serve.py`` system names to deploy, with the
  baselines' sweep (Dynamo-style over the same budget's allocations, ``aggregated@1024/2048/4096``).
  ``--save`` writes it to ``benchmarks/results/has_hardware_plan_h200.json``, which ``--deploy``
  reads: the GPU machine has no Optuna, and the deployed names must be the committed plan's.
  ``--mps 85`` plans every system under that SM cap; ``--mps 50,70,85`` searches the cap too (HAS
  once per cap, the pick the best of their picks; run 23 in docs/benchmarks.md).
- ``--deploy --out DIR`` (GPU machine): ``gpu_goodput.py`` (gpu_serve at 300 requests a point)
  over the plan's systems (``--group has|baselines|all``), one system at a time, each point saved
  as it is measured (``DIR/gpu_serve.json``); a system whose estimated time (start-up, warm-up,
  its points, drain) does not fit ``--budget-s`` is skipped and named. Systems already measured
  in committed ``benchmarks/results/has_hardware_h200_*.json`` files are not run again, so a
  cut-off call is finished by committing its file and calling again.
- ``--summary`` (CPU): item 5's verdict from the committed result files: the pick's measured
  goodput at the moderate tier against the best measured of (baselines' sweep and HAS's top 3),
  their ratio and whether it is at least 0.95, with the twin's prediction beside each figure.

Why ``--pods 3``: on one GPU the topology's GPU count is free (the launcher wraps pods onto the
host GPU), so the budget is the number of pods. Three is what the systems measured on the H200
already run (Dynamo-style E1 P1 D1) and what fits memory at gpu_serve's ``kvMemoryFraction`` 0.45
(each pod holding the backbone takes ~15 GB; a fourth would leave the decode worker a few GB of
KV). The space is restricted to TP 1 (``tp_options=(1,)``): the torch engine has no tensor
parallelism, and a TP-2 pool would be refused by the spec model. Since pods on one GPU are not
hardware, the space holds every layout of at most ``--pods`` pods (``full_only`` off): fewer pods
time-slice the GPU less.

    python benchmarks/has_hardware.py --plan --rate 3.5 --save
    # GPU machine, two calls (~6.5 and ~8.5 minutes), then commit each DIR/gpu_serve.json as
    # benchmarks/results/has_hardware_h200_<has|baselines>.json
    bash benchmarks/devsite.sh; export PYTHONPATH=.devsite/site:.devsite:runtime:operator
    python3 benchmarks/has_hardware.py --deploy --group has --budget-s 520 --out $OUT/has
    python3 benchmarks/has_hardware.py --deploy --group baselines --budget-s 520 --out $OUT/baselines
    python benchmarks/has_hardware.py --summary
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serve  # noqa: E402
import twin_agreement as ta  # noqa: E402
from gpu_systems import base_of, point  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PLAN = RESULTS / "has_hardware_plan_h200.json"
MEASURED = str(RESULTS / "has_hardware_h200_*.json")
HOST_GPUS = 1  # one H200 is lent: every pod of a system runs on it
PROFILES = (gpu_serve.ENGINE_PROFILE, gpu_serve.ENGINE_PROFILE_CPU_PRE)
"""The engine profile the twin is calibrated with, and its CPU-preprocessing encode points (for the
Dynamo-style systems): ``twin_agreement.py --measure`` of the engine that run 12 deploys (flash
prefill), with the serving path and the decode loop's overhead calibrated at zero load
(``--calibrate-path``); its CPU-preprocessing encode points are run 11's (that file of run 12 did
not come back from the device). The deployed systems are served with the same file
(``gpu_serve.ENGINE_PROFILE``). Earlier plans name theirs (``--profile``)."""
PODS = 3
REQUESTS = 300  # gpu_goodput.py's points
SLO_SCALE, KV_FRACTION = 4.0, 0.45  # gpu_serve.py's defaults, which the deploy runs with
TIER = "moderate"
TRIALS = 30  # HAS's trial budget (stop rules on, as easerve tune runs; a twin trial takes ~0.1 s)
TOP = 3
AGGREGATED_TOKENS = (1024, 2048, 4096)
BAR = 0.95
# a system's GPU time at one host (committed runs: start-up 11-21 s; a point is requests / rate plus the drain)
STARTUP_S, WARMUP_S, DRAIN_S, STOP_S = 20.0, 5.0, 10.0, 5.0


def log(msg: str) -> None:
    print(f"[has_hardware {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the twin's side
def twin_doc(system: str, tmp: Path, preprocessing: str | None = None) -> dict[str, Any]:
    """The spec ``gpu_serve.py`` deploys for ``system``, served by the twin on the measured profile
    (twin_agreement's way: the CPU-preprocessing encode points for a system that preprocesses on the
    CPU); ``preprocessing`` overrides the system's own (``spec.encode.preprocessing``)."""
    doc = gpu_serve.spec_doc(system, Path("model"), SLO_SCALE, KV_FRACTION, gpus=gpu_serve.aggregated_gpus(HOST_GPUS))
    if preprocessing is not None:
        doc["spec"].setdefault("encode", {})["preprocessing"] = preprocessing
        cpu = preprocessing == "cpu"
        pfile = ta.merged_profile(tmp, PROFILES[0], PROFILES[1] if cpu and PROFILES[1].exists() else None)
        return ta.twin_spec(doc["spec"], pfile)
    return ta.twin_spec(doc["spec"], ta.system_profile(system, tmp, PROFILES[0], PROFILES[1]))


def predict(system: str, rate: float, requests: int, tmp: Path, host_gpus: int = HOST_GPUS) -> dict[str, Any]:
    """The twin's figures for ``system`` deployed at ``rate`` (twin_agreement's way: same requests)."""
    from easerve_runtime.api import parse_spec

    s = ta.twin_point(parse_spec(twin_doc(system, tmp)), rate, requests, host_gpus, ta.mps_caps_of(system))
    return {"goodput": round(s["goodput"].get(TIER, 0.0), 4), "throughput": round(s["throughput"], 4),
            "ttft_p99": round(s["ttft_p99"], 4), "tpot_p99": round(s["tpot_p99"], 5)}


def has_search(rate: float, pods: int, requests: int, trials: int, seed: int, tmp: Path,
               progress: bool = True, preprocessing: str = "gpu", mps: int | None = None) -> tuple[Any, list[Any]]:
    """HAS on the calibrated twin (``search.tune``, as ``easerve tune --backend sim`` runs it, its
    trials time-slicing one host GPU); returns the result and its distinct successful trials,
    best first by the tuner's own ranking (goodput; a tie to the baseline, then by mean TTFT, then TPOT)."""
    from easerve_operator.tuning.loop import StopRules, baseline_first
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.selection import Objective, rank
    from easerve_operator.tuning.space import space_for
    from easerve_runtime.api import parse_spec

    base = twin_doc("easerve" if mps is None else f"easerve+mps{mps}", tmp, preprocessing=preprocessing)
    base["gpuBudget"] = pods
    base.pop("allocation")  # HAS chooses it
    spec = parse_spec(base)
    profiler = SimStageProfiler(spec, rate=rate)
    # Pods that share host GPUs are not hardware: a layout of fewer pods than the budget time-slices
    # the GPU less, and can win there (run 10: E1 P0 D1 measured above every 3-pod layout). So the
    # space holds every layout within the budget, not only those that use all of it.
    space = space_for(spec, profiler.min_tp(), local_tp=profiler.local_prefill_tp(), tp_options=(1,),
                      full_only=pods <= HOST_GPUS)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=trials, desc="HAS on the twin", unit="trial", file=sys.stderr)

    def on_trial(rec: Any, records: list[Any]) -> None:
        if bar is not None and not rec.cached:
            bar.update(1)

    try:
        caps = None if mps is None else ta.mps_caps_of(f"easerve+mps{mps}")
        # through the one frontend's door (sim.frontdoor), as easerve serve deploys a plan and as
        # twin_agreement.twin_point predicts the GPU runs: past saturation the frontend refuses
        # requests (run 28: up to 45 of 300 at 10 req/s) and the admitted ones keep their tail
        runner = SimRunner(host_gpus=HOST_GPUS, mps_caps=caps, frontends=1)
        result = tune(spec, runner=runner, profiler=profiler, space=space, rate=rate,
                      objective=f"goodput@{TIER}", rules=StopRules(budget=trials), seed=seed,
                      workload_seed=ta.BENCH_SEED, requests=requests, on_trial=on_trial)
    finally:
        if bar is not None:
            bar.close()
    distinct: dict[Any, Any] = {}
    for r in result.real_trials:
        if r.ok:
            distinct.setdefault(r.candidate.key(), r)
    ranked = rank(list(distinct.values()), lambda r: r.metrics, Objective.parse(f"goodput@{TIER}"),
                  prefer=baseline_first)
    return result, ranked


def system_of(c: Any, preprocessing: str = "gpu", mps: int | None = None) -> str:
    """The ``gpu_serve.py`` name that deploys HAS candidate ``c`` (``space.Candidate``) with
    ``spec.encode.preprocessing`` = ``preprocessing`` (and under MPS caps of ``mps`` %)."""
    name = point("easerve", c.alloc, c.batch_bound, c.offload_ratio, preprocessing).name
    return name if mps is None else f"{name}+mps{mps}"


def plan(rate: float, pods: int = PODS, requests: int = REQUESTS, trials: int = TRIALS, seed: int = 0,
         progress: bool = True, pre: str = "gpu", mps: int | list[int] | None = None) -> dict[str, Any]:
    """HAS's plan at ``rate``: its pick and top 3, the baselines, each with the twin's figures; every
    EAServe candidate preprocessing as ``pre`` says (``spec.encode.preprocessing``: HAS does not
    search it).

    ``mps``: the SM cap of the encode and prefill processes (``+mpsNN``), or several: then the cap
    is a dimension of the search. HAS runs once per cap (its trial budget each); the plan's pick is
    the best of those searches' own picks by the tuner's ranking, and the rest of their distinct
    trials, ranked the same way, fill the top; the Dynamo-style baselines are swept over the same
    caps. Why: the cap trades the encode and prefill processes' pace against the GPU they leave,
    and at 7 req/s on an H100 it moved Dynamo-style's measured goodput 1.5x (run 22: 4.27 at
    70 %, 2.86 at 85 %); a plan held to one cap could not follow that."""
    from easerve_operator.tuning.loop import baseline_first
    from easerve_operator.tuning.selection import Objective, rank
    from easerve_operator.tuning.space import enumerate_allocations

    caps: list[int | None] = [None] if mps is None else ([mps] if isinstance(mps, int) else list(mps))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        searches = []  # (cap, result, ranked)
        for cap in caps:
            result, ranked = has_search(rate, pods, requests, trials, seed, tmp, progress, pre, cap)
            if result.best is not None:
                searches.append((cap, result, ranked))
        if not searches:
            raise SystemExit("HAS found no configuration that served on the twin")
        # each search's pick is its tuner's best (result.best); the plan's pick is the best of those
        # by the same ranking, then the rest of every search's distinct trials fill the top
        obj = Objective.parse(f"goodput@{TIER}")
        bests = [(cap, next(r for r in ranked if r.candidate.key() == res.best.candidate.key()))
                 for cap, res, ranked in searches]
        def baseline(cr: Any) -> bool:  # the tuner's tie rule, on (cap, trial) pairs
            return baseline_first(cr[1])

        pick = rank(bests, lambda cr: cr[1].metrics, obj, prefer=baseline)[0]
        rest = [(cap, r) for cap, _, ranked in searches for r in ranked if r is not pick[1]]
        top = [pick, *rank(rest, lambda cr: cr[1].metrics, obj, prefer=baseline)[: TOP - 1]]

        def entry(cap: int | None, r: Any) -> dict[str, Any]:
            name = system_of(r.candidate, pre, cap)
            return {"system": name, **r.candidate.to_dict(), "mps": cap, "has_trial_goodput": round(r.value, 4),
                    "twin": predict(name, rate, requests, tmp)}

        dynamo = [point("dynamo-style", a).name + ("" if cap is None else f"+mps{cap}")
                  for cap in caps for a in enumerate_allocations(pods, 1, local_prefill=False, tp_options=(1,))]
        baselines = [*dynamo, *(f"aggregated@{k}" for k in AGGREGATED_TOKENS)]
        tops = [entry(cap, r) for cap, r in top]
        first = searches[0][1]
        out = {
            "bench": "has_hardware", "mode": "plan", "rate": rate, "pods": pods, "host_gpus": HOST_GPUS, "preprocessing": pre,
            "mps": tops[0]["mps"] if len(caps) > 1 else mps, **({"mps_searched": caps} if len(caps) > 1 else {}),
            "requests": requests, "seed": ta.BENCH_SEED, "slo_scale": SLO_SCALE, "objective": f"goodput@{TIER}",
            "profile": str(PROFILES[0].relative_to(REPO)), "space": first.space.to_dict(),
            "has": {"trials": sum(len(res.real_trials) for _, res, _ in searches),
                    "trial_budget": trials * len(caps), "stop": first.stop_reason if len(caps) == 1 else
                    {str(cap): res.stop_reason for cap, res, _ in searches},
                    "stage1_kept": [s.alloc.label for s in first.stage1.seeds] if first.stage1 else [],
                    "tried": [{"system": system_of(r.candidate, pre, cap), "goodput": None if r.value is None else round(r.value, 4)}
                              for cap, res, _ in searches for r in res.real_trials]},
            "pick": tops[0]["system"], "top": tops,
            "baselines": [{"system": b, "twin": predict(b, rate, requests, tmp)} for b in baselines],
            "groups": {"has": [e["system"] for e in tops], "baselines": baselines},
        }
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


# ------------------------------------------------------------------ the GPU's side
def measured_points(files: list[Path]) -> dict[tuple[str, float], dict[str, Any]]:
    """Every (system, rate) point of the result files, with the file's host and its name; a point
    measured more than once is the mean of its repeats (``gpu_serve.mean_of_repeats``: which
    one counts would be a choice the verdict must not make), each repeat listed."""
    reps: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for f in files:
        res = json.loads(f.read_text())
        for name, s in res.get("systems", {}).items():
            for p in s.get("points", []):
                reps.setdefault((name, float(p["rate"])), []).append({**p, "file": f.name, "host_gpus": res.get("host_gpus")})
    out = {k: gpu_serve.mean_of_repeats(ps) for k, ps in reps.items()}
    for p in out.values():
        if "repeats" in p:
            p["file"] = ",".join(r["file"] for r in p["repeats"])
    return out


def system_cost_s(rates: list[float], requests: int) -> float:
    """Estimated GPU wall time of one system at ``rates`` (start-up, warm-up, points, drain, stop)."""
    return STARTUP_S + WARMUP_S + sum(requests / r + DRAIN_S for r in rates) + STOP_S


def deploy(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    pl = json.loads(Path(args.plan_file).read_text())
    systems = pl["groups"]["has"] + pl["groups"]["baselines"] if args.group == "all" else pl["groups"][args.group]
    rates = args.rates or [float(pl["rate"])]
    done = measured_points([Path(f) for f in ta.run_files(args.measured)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / "gpu_serve.json"
    if not result.exists():  # gpu_serve keeps keys it does not know: the file says which plan it measured
        result.write_text(json.dumps({"has_hardware_plan": {k: pl[k] for k in ("rate", "pods", "pick", "groups")}}))
    ran, skipped = [], []
    for system in systems:
        todo = [r for r in rates if (system, r) not in done]
        if not todo:
            log(f"{system}: measured already ({', '.join(sorted({done[(system, r)]['file'] for r in rates}))})")
            continue
        left = args.budget_s - (time.monotonic() - t0)
        need = system_cost_s(todo, args.requests)
        if need > left:
            log(f"{system}: skipped, needs ~{need:.0f} s of the {left:.0f} s left")
            skipped.append({"system": system, "rates": todo, "needs_s": round(need), "left_s": round(left)})
            continue
        cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_goodput.py"), "--out", str(out), "--systems", system,
               "--rates", ",".join(f"{r:g}" for r in todo), "--requests", str(args.requests),
               "--budget-s", str(int(left)), "--size", args.size, "--start-timeout", str(args.start_timeout),
               "--profile-file", str(REPO / pl["profile"])]  # served with the profile the plan's twin used
        log(f"{system}: {' '.join(cmd[2:])}")
        with open(out / "gpu_serve.stdout.log", "a") as f:
            rc = subprocess.run(cmd, stdout=f, check=False).returncode
        ran.append({"system": system, "rates": todo, "rc": rc})
    report = {"bench": "has_hardware", "mode": "deploy", "plan": pl["pick"], "group": args.group, "ran": ran,
              "skipped": skipped, "result": str(result), "wall_s": round(time.monotonic() - t0, 1)}
    (out / "has_hardware_deploy.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


# ------------------------------------------------------------------ the verdict
def verdict(pl: dict[str, Any], points: dict[tuple[str, float], dict[str, Any]], tmp: Path) -> dict[str, Any]:
    """Item 5 at each rate the pick was measured at: the pick's goodput against the best of the
    compared set (HAS's top 3, the pick among them, and the baselines' sweep), measured.

    The sweep is every baseline configuration measured at that rate in the files, not only the
    plan's list: a Dynamo-style system measured under other SM caps (``+mps50``) is a point of the
    baselines' sweep too, and leaving it out would flatter the pick (``sweep_extra`` names them)."""
    planned = pl["groups"]["has"] + pl["groups"]["baselines"]
    rates = sorted({r for (s, r) in points if s == pl["pick"]})
    out: dict[str, Any] = {"pick": pl["pick"], "tier": TIER, "bar": BAR, "rates": {}}
    for rate in rates:
        extra = sorted(s for (s, r) in points
                       if r == rate and s not in planned and base_of(s) in ("dynamo-style", "aggregated"))
        contenders = planned + extra
        rows: dict[str, Any] = {}
        for s in contenders:
            p = points.get((s, rate))
            if p is None:
                continue
            rows[s] = {"measured": round(gpu_serve.goodput_of(p, TIER), 4),
                       "twin": predict(s, rate, int(p["requests"]), tmp, int(p.get("host_gpus") or HOST_GPUS))["goodput"],
                       "role": "has" if s in pl["groups"]["has"] else base_of(s),
                       **({"repeats": [r["goodput_moderate"] for r in p["repeats"]]} if "repeats" in p else {})}
        best = max(rows, key=lambda s: rows[s]["measured"])
        mine, top = rows[pl["pick"]]["measured"], rows[best]["measured"]
        ratio = mine / top if top > 0 else None
        out["rates"][f"{rate:g}"] = {
            "pick_goodput": mine, "best": best, "best_goodput": top,
            "ratio": None if ratio is None else round(ratio, 4),
            "meets_bar": None if ratio is None else ratio >= BAR,
            "complete": all(s in rows for s in planned),
            "not_measured": [s for s in planned if s not in rows],
            "sweep_extra": extra,
            "systems": rows,
        }
    return out


def failures(files: list[Path]) -> dict[str, str]:
    """The systems a run could not serve, and why (gpu_serve records the error, e.g. a start-up
    timeout): they are in no verdict's compared set, and the summary says so."""
    out: dict[str, str] = {}
    for f in files:
        for name, s in json.loads(f.read_text()).get("systems", {}).items():
            if s.get("error"):
                out[name] = f"{f.name}: {s['error'][:300]}"
    return out


def summary(plan_file: Path, files: list[Path]) -> dict[str, Any]:
    pl = json.loads(plan_file.read_text())
    points = measured_points(files)
    with tempfile.TemporaryDirectory() as t:
        v = verdict(pl, points, Path(t))
    return {"bench": "has_hardware", "mode": "summary", "plan": str(plan_file.name), "plan_rate": pl["rate"],
            "files": [{"file": f.name, **{k: json.loads(f.read_text()).get(k) for k in ("measured", "gpu", "host_gpus")}}
                      for f in files], **v, "failed": failures(files)}


def main(argv: list[str] | None = None) -> int:
    global PROFILES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="HAS on the calibrated twin (default; CPU)")
    mode.add_argument("--deploy", action="store_true", help="deploy the plan's systems (GPU machine)")
    mode.add_argument("--summary", action="store_true", help="item 5's verdict from the committed results")
    ap.add_argument("--rate", type=float, default=3.5, help="--plan: the target rate Λ (req/s)")
    ap.add_argument("--pods", type=int, default=PODS, help="--plan: GPU budget of the topology (pods on the one GPU)")
    ap.add_argument("--requests", type=int, default=REQUESTS, help="requests per trial (--plan) / per point (--deploy)")
    ap.add_argument("--trials", type=int, default=TRIALS, help="--plan: HAS's trial budget")
    ap.add_argument("--seed", type=int, default=0, help="--plan: HAS's search seed")
    ap.add_argument("--mps", type=lambda v: [int(x) for x in v.split(",")], default=None, metavar="PERCENT[,PERCENT...]",
                    help="--plan: every EAServe candidate and Dynamo-style baseline served under MPS with its "
                         "encode and prefill processes capped at PERCENT of the SMs (+mpsNN; the twin's sim.mpsshare); "
                         "several caps (70,85): the cap is searched too, HAS run once per cap")
    ap.add_argument("--preprocessing", choices=["gpu", "cpu"], default="gpu",
                    help="--plan: spec.encode.preprocessing of every EAServe candidate (run 13: cpu)")
    ap.add_argument("--save", nargs="?", const=str(PLAN), default=None, help="--plan: write the plan here")
    ap.add_argument("--plan-file", default=str(PLAN), help="--deploy/--summary: the plan")
    ap.add_argument("--group", choices=["has", "baselines", "all"], default="all", help="--deploy: which systems")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="--deploy: rates (default: the plan's)")
    ap.add_argument("--out", default=None, help="--deploy: output directory ($OUT/...)")
    ap.add_argument("--budget-s", type=float, default=540, help="--deploy: wall-clock budget of this call")
    ap.add_argument("--start-timeout", type=float, default=120,
                    help="--deploy: seconds a system may take to serve (runs took 11-21 s; one that cannot "
                         "start, e.g. out of KV memory, would otherwise hold the GPU for gpu_serve's 400 s)")
    ap.add_argument("--size", default="7b", choices=["tiny", "7b"], help="--deploy: tiny is a CPU smoke")
    ap.add_argument("--measured", default=MEASURED, help="--deploy/--summary: result files (globs, comma-separated)")
    ap.add_argument("--profile", default=None,
                    help="the engine profile the twin is calibrated with (its CPU-preprocessing twin beside it); "
                         f"default: --plan {PROFILES[0].relative_to(REPO)}, --summary the plan's own")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    # --summary's twin column predicts with the profile the plan was made with, unless told
    # otherwise: with the shipped H200 profile beside an H100 plan it read another twin's numbers
    planned = json.loads(Path(args.plan_file).read_text()).get("profile") if args.summary and Path(args.plan_file).exists() else None
    prof = Path(args.profile or (REPO / planned if planned else PROFILES[0])).resolve()
    PROFILES = (prof, ta.cpu_preprocess_of(prof))
    if args.summary:
        files = [Path(f) for f in ta.run_files(args.measured)]
        if not files:
            raise SystemExit(f"no result files match {args.measured}: run --deploy on the GPU machine first")
        print(json.dumps(summary(Path(args.plan_file), files), indent=1))
        return 0
    if args.deploy:
        if not args.out:
            ap.error("--deploy needs --out")
        return deploy(args)
    doc = plan(args.rate, args.pods, args.requests, args.trials, args.seed, progress=not args.no_progress,
               pre=args.preprocessing, mps=None if args.mps is None else (args.mps[0] if len(args.mps) == 1 else args.mps))
    line = json.dumps(doc)
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"plan: {args.save}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
