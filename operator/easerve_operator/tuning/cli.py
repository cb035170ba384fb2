"""``easerve tune``: run HAS (or a baseline) for a deployment file and report why it chose what.

    easerve tune -f examples/llava-v1.6-34b.yaml --backend sim --rate 5 --budget 30 --json
    easerve tune -f examples/llava-v1.6-34b.yaml --backend cluster --namespace ns \
        --prometheus-url http://prometheus:9090 --rate 2 --budget 6

``--backend cluster`` runs every trial on the current kube context (``runners.kube.KubeRunner``:
the trial rolled out as the deployment's children, a load Job, the score from Prometheus) with
the same search, progress bar and report; each trial's Prometheus figures, the load Job's own
report and the phase times are in ``<out>/trials/trial-<n>.json`` and in the report under
``cluster_trials``. Its Stage 1 runs as profiling Jobs on the same cluster
(``runners.kube_profile``; reports under ``--out``/profile, reused by ``--resume``), unless
``--profile-on twin``.

Shows a progress bar on stderr (trial k/N, best so far), prints the chosen (allocation, B, s)
with its metrics and the Stage-1 table (every allocation, its capacities and score, kept or
pruned and why), and writes ``report.json``, ``convergence.png`` and the trial records
``trials.jsonl`` to ``--out``. A killed search continues with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HELP = "Search the deployment configuration (allocation, encode batch bound B, offload ratio s) with HAS."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="EPDDeployment manifest (YAML).")
    parser.add_argument(
        "--backend",
        choices=["sim", "cluster"],
        default="sim",
        help="Trial backend: sim (the twin) or cluster (the current kube context, scored from Prometheus).",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="Λ, req/s (default: spec.tuning.targetRate)."
    )
    parser.add_argument(
        "--budget", type=int, default=None, help="Most trials (default: spec.tuning.trialBudget)."
    )
    parser.add_argument(
        "--objective", default=None, help="throughput or goodput@TIER (default: spec.tuning.objective)."
    )
    parser.add_argument(
        "--method", choices=["has", "random", "coordinate"], default="has", help="Search method."
    )
    parser.add_argument("--seed", type=int, default=0, help="Search seed (sampler, baselines).")
    parser.add_argument(
        "--workload-seed", type=int, default=1, help="Seed of the trial workload (same every trial)."
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="Requests per trial (default: spec.tuning.requestsPerTrial).",
    )
    parser.add_argument(
        "--max-batch", type=int, default=16, help="Largest encode batch bound B in the space."
    )
    parser.add_argument("--s-step", type=float, default=0.1, help="Grid step of the offload ratio s.")
    parser.add_argument("--no-local-prefill", action="store_true", help="Pin s = 1 (no local prefill).")
    parser.add_argument(
        "--out", default=None, help="Output directory (default: benchmarks/out/tune-<name>/)."
    )
    parser.add_argument("--resume", action="store_true", help="Continue the search recorded in --out.")
    parser.add_argument(
        "--fresh", action="store_true", help="Discard records already in --out and start over."
    )
    parser.add_argument("--json", action="store_true", help="Print the report as JSON on stdout.")
    cl = parser.add_argument_group("cluster backend")
    cl.add_argument(
        "--profile-on", choices=["cluster", "twin"], default="cluster",
        help="Stage 1 with --backend cluster: profiling Jobs on the cluster (default) or the twin's profiler.",
    )
    cl.add_argument(
        "--namespace", default=None, help="Namespace of the trials (default: the manifest's, else default)."
    )
    cl.add_argument(
        "--prometheus-url",
        default=None,
        help="Prometheus base URL (default: spec.observability.prometheusUrl).",
    )
    cl.add_argument(
        "--prometheus-label",
        default="epd_deployment",
        help="Prometheus label holding the trial's name (the chart's PodMonitor: epd_deployment).",
    )
    cl.add_argument(
        "--ready-timeout", type=float, default=600.0, help="Seconds a trial may take to get ready."
    )
    cl.add_argument(
        "--warmup", type=float, default=0.1, help="Fraction of each trial's run cut off as warm-up (0.1)."
    )
    cl.add_argument(
        "--trace", default=None, help="JSONL trace the load Job replays instead of Poisson arrivals."
    )
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")


def _fail(msg: str) -> int:
    print(f"easerve tune: error: {msg}", file=sys.stderr)
    return 2


def stage1_lines(result: Any) -> list[str]:
    if result.stage1 is None:
        return []
    c = result.stage1.capacities
    lines = [
        f"Stage 1 at Λ={result.rate:g} req/s: C_E={c.c_e:.3f} (B_sat={c.b_sat}), "
        + "C_P="
        + ", ".join(f"tp{k}:{v:.3f}" for k, v in sorted(c.c_p.items()))
        + "; C_D="
        + ", ".join(f"tp{k}:{v:.3f}" for k, v in sorted(c.c_d.items()))
        + f"; α={c.alpha:.3f} ({c.alpha_source}); profiling cost {c.parallel_cost_s:.1f} s device time (concurrent)",
        f"{'allocation':<24} {'Cap_E':>7} {'Cap_P':>7} {'Cap_D':>7} {'score':>7}  verdict",
    ]
    for r in result.stage1.rows:
        verdict = ("KEPT   " if r.kept else "pruned ") + r.reason
        lines.append(
            f"{r.alloc.label:<24} {r.cap_e:7.3f} {r.cap_p:7.3f} {r.cap_d:7.3f} {r.score:7.3f}  {verdict}"
        )
    lines.append(f"kept {len(result.stage1.seeds)} of {len(result.stage1.rows)} allocations")
    return lines


def best_lines(result: Any) -> list[str]:
    b = result.best
    if b is None:
        return ["no successful trial: nothing to choose"]
    m = b.metrics
    good = ", ".join(f"{k}={v:.3f}" for k, v in m.goodput.items())
    return [
        f"chosen ({result.method}, {result.objective}, stop: {result.stop_reason} after "
        f"{len(result.real_trials)} trials): allocation {b.allocation}, B={b.batch_bound}, s={b.offload_ratio:g}",
        f"  throughput {m.throughput:.3f} req/s, mean TTFT {m.ttft_mean:.3f} s, mean TPOT {m.tpot_mean * 1e3:.1f} ms, "
        f"goodput {good}",
    ]


def plot_convergence(result: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conv = result.convergence()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p["trial"] for p in conv]
    ax.plot(xs, [p["best"] for p in conv], drawstyle="steps-post", label="best so far")
    seeded = [t.seeded for t in result.real_trials]
    vals = [p["value"] for p in conv]
    ax.scatter(
        [x for x, v, s in zip(xs, vals, seeded, strict=True) if v is not None and not s],
        [v for v, s in zip(vals, seeded, strict=True) if v is not None and not s],
        s=14,
        label="trial",
    )
    ax.scatter(
        [x for x, v, s in zip(xs, vals, seeded, strict=True) if v is not None and s],
        [v for v, s in zip(vals, seeded, strict=True) if v is not None and s],
        s=30,
        marker="*",
        label="Stage-1 seed",
    )
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{result.objective} (req/s)")
    ax.set_title(f"{result.method} at Λ={result.rate:g} req/s (stop: {result.stop_reason})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def manifest_namespace(path: str) -> str | None:
    import yaml

    for d in yaml.safe_load_all(Path(path).read_text()):
        if d and d.get("kind") == "EPDDeployment":
            ns = (d.get("metadata") or {}).get("namespace")
            return None if ns is None else str(ns)
    return None


def cluster_runner(args: argparse.Namespace, name: str, spec: Any, out: Path) -> Any:
    """The ``KubeRunner`` for ``--backend cluster`` on the current kube context.

    Trials are owner-referenced to the EPDDeployment ``name`` when it exists in the namespace
    (deleting it deletes them), else only labelled. The first trial number follows the trials
    already recorded in ``--out`` (a resumed search never reuses a name).
    """
    from easerve_operator.tuning.prometheus import PrometheusScorer
    from easerve_operator.tuning.records import RecordStore
    from easerve_operator.tuning.runners.kube import KubeRunner, KubeTrialCluster

    url = args.prometheus_url or spec.observability.prometheus_url
    if not url:
        raise ValueError("--prometheus-url: not given and spec.observability.prometheusUrl is not set")
    if not 0.0 <= args.warmup < 1.0:
        raise ValueError(f"--warmup: must be in [0, 1), got {args.warmup}")
    if args.ready_timeout <= 0:
        raise ValueError(f"--ready-timeout: must be > 0, got {args.ready_timeout}")
    namespace = args.namespace or manifest_namespace(args.file) or "default"
    trace = Path(args.trace).read_text() if args.trace else None
    cluster = KubeTrialCluster()
    uid = cluster.owner_uid(namespace, name)
    if uid is None:
        print(
            f"easerve tune: EPDDeployment {namespace}/{name} not found: trials are labelled, not owned",
            file=sys.stderr,
        )
    store = RecordStore(out)
    done = len(store.load()[2]) if args.resume and store.exists() else 0
    return KubeRunner(
        cluster=cluster,
        deployment=name,
        namespace=namespace,
        uid=uid,
        scorer_for=lambda trial: PrometheusScorer(
            url, {"namespace": namespace, args.prometheus_label: trial}
        ),
        trace=trace,
        ready_timeout_s=args.ready_timeout,
        warmup_fraction=args.warmup,
        first_trial=done + 1,
        report_dir=out / "trials",
    )


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.api import load_manifest, spec_errors
    from pydantic import ValidationError

    from easerve_operator.tuning.loop import StopRules
    from easerve_operator.tuning.records import RecordStore
    from easerve_operator.tuning.runners.sim import SimRunner, SimStageProfiler
    from easerve_operator.tuning.search import tune
    from easerve_operator.tuning.selection import Objective
    from easerve_operator.tuning.space import space_for

    try:
        name, spec = load_manifest(args.file)
    except ValidationError as exc:
        return _fail("; ".join(spec_errors(exc)))
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    rate = args.rate if args.rate is not None else spec.tuning.target_rate
    if rate is None:
        return _fail("--rate: not given and spec.tuning.targetRate is not set")
    if rate <= 0:
        return _fail(f"--rate: must be > 0, got {rate}")
    budget = args.budget if args.budget is not None else spec.tuning.trial_budget
    if budget < 1:
        return _fail(f"--budget: must be >= 1, got {budget}")
    requests = args.requests if args.requests is not None else spec.tuning.requests_per_trial
    if requests < 1:
        return _fail(f"--requests: must be >= 1, got {requests}")
    objective = args.objective or spec.tuning.objective
    try:
        Objective.parse(objective, [t.name for t in spec.slo.tiers])
    except ValueError as exc:
        return _fail(f"--{exc}")
    if args.resume and args.fresh:
        return _fail("--resume and --fresh exclude each other")
    out = Path(args.out) if args.out else Path("benchmarks/out") / f"tune-{name}"
    store = RecordStore(out)
    if args.fresh:  # only our own files: --out may be a directory the user cares about
        for f in (store.path, out / "report.json", out / "convergence.png"):
            f.unlink(missing_ok=True)
    if store.exists() and not args.resume:
        return _fail(f"--out: {store.path} already holds a search; pass --resume to continue it or --fresh")

    runner: Any = SimRunner()
    if args.backend == "cluster":
        try:
            runner = cluster_runner(args, name, spec, out)
        except (OSError, ValueError) as exc:
            return _fail(str(exc))

    try:
        profiler: Any = SimStageProfiler(spec, rate=rate)  # loads the profile: a SpecError names the field
        space = space_for(
            spec,
            profiler.min_tp(),
            max_batch=args.max_batch,
            s_step=args.s_step,
            local_prefill=not args.no_local_prefill,
            local_tp=profiler.local_prefill_tp(),
        )
    except ValueError as exc:
        return _fail(str(exc))
    if args.backend == "cluster" and args.profile_on == "cluster":
        from easerve_operator.tuning.runners.kube_profile import ClusterStageProfiler

        tps = sorted({a.prefill_tp for a in space.allocations} | {a.decode_tp for a in space.allocations})
        profiler = ClusterStageProfiler(runner.cluster, name, runner.namespace, spec, rate=rate, tps=tps,
                                        max_batch=space.max_batch, report_dir=out / "profile", uid=runner.uid)

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=budget, desc=f"HAS {args.method}", unit="trial", file=sys.stderr, leave=True)

    def on_trial(rec: Any, records: list[Any]) -> None:
        if bar is None or rec.cached:
            return
        vals = [r.value for r in records if r.ok and not r.cached]
        bar.update(1)
        bar.set_postfix_str(f"best {max(vals):.3f}" if vals else "best -")

    try:
        result = tune(
            spec,
            runner=runner,
            profiler=profiler,
            space=space,
            rate=rate,
            method=args.method,
            objective=objective,
            rules=StopRules(budget=budget),
            seed=args.seed,
            workload_seed=args.workload_seed,
            requests=requests,
            store=store,
            resume=args.resume,
            on_trial=on_trial,
        )
    except (ValueError, FileExistsError) as exc:
        return _fail(str(exc))
    finally:
        if bar is not None:
            bar.close()

    report = {"name": name, "file": str(args.file), "backend": args.backend, **result.to_dict()}
    if args.backend == "cluster":
        report["cluster_trials"] = runner.history
        if hasattr(profiler, "report"):
            report["cluster_profile"] = profiler.report()
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    plot_convergence(result, out / "convergence.png")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for line in best_lines(result) + [""] + stage1_lines(result):
            print(line)
        print(f"\nwrote {out / 'report.json'}, {out / 'convergence.png'}, {store.path}")
    return 0 if result.best is not None else 1
