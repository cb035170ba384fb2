"""Goodput on real GPUs: EAServe against the Dynamo-style and aggregated baselines on the same engine,
per SLO tier, over a ladder of rates, from runs of ``gpu_serve.py`` (issue 17, item 2).

A GPU sweep is several device calls (a call is at most 10 minutes; four systems at three rates of
300 requests do not fit one), each a ``gpu_serve.py`` run on the same machine and the same code,
saved as ``benchmarks/results/gpu_serve_h200_<run><part>_300req.json`` (``run9``, ``run9b``, ...);
from run 10 on, ``has_hardware.py --deploy`` makes the same runs, ``has_hardware_h200_<run><part>.json``.
This script merges the parts of one run into one table: per system, goodput per tier at each rate
and the best-over-rates goodput at the moderate tier; EAServe's ratios to each baseline (best
over rates, and rate by rate, where EAServe is the better of its measured layouts and each
baseline the best of its measured configurations, e.g. ``aggregated@1024,aggregated@4096`` beside
``aggregated``'s default 2,048-token budget: the sweep, printed under ``baselines_swept``); and a
plot.

    # on the GPU machine, one call per group of systems (see docs/benchmarks.md, run 9):
    python3 benchmarks/gpu_goodput.py --out $OUT/serve --systems easerve-own-process,dynamo-style --rates 3.5,5.5
    # anywhere, no GPU: the committed runs' merged summary (default: CURRENT_RUNS)
    python3 benchmarks/gpu_goodput.py --summary [--run run9] [--plot docs/img/gpu_goodput_run9.png]

The baselines' configurations are ``gpu_serve.py``'s (its docstring says which); the aggregated
baseline's token budget is swept by naming ``aggregated@TOKENS`` systems, the Dynamo-style
allocation by naming ``dynamo-style:ALLOC`` systems (``gpu_systems.py``; on one GPU every pod of
each shares it), and ``easerve:ALLOC:bB:sS`` points count among EAServe's layouts.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serve  # noqa: E402
from gpu_systems import base_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
EASERVE = ("easerve", "easerve-own-process")
BASELINES = ("dynamo-style", "aggregated")
_RUN = re.compile(r"(?:gpu_serve_h[12]00_(run\d+)([a-z]?)_300req|has_hardware_h200_(run\d+)([a-z]?))\.json$")
"""A run's parts: ``gpu_serve.py``'s own sweeps (on an H200 up to run 17, on an H100 in run 18), and
the deploys of ``has_hardware.py`` (the same ``gpu_serve.py`` runs at 300 requests a point, from
run 10 on)."""
PATTERNS = ("gpu_serve_h[12]00_run*_300req.json", "has_hardware_h200_run*.json")

_RACY_KV = ("kvMemoryFraction counted the card-mates' memory until 0263c49, so the decode's KV slots "
            "depended on which process loaded first")
EXCLUDED: dict[tuple[str, str], str] = {
    ("gpu_serve_h100_run18b_300req.json", "dynamo-style:e1p1d1+mps85"): f"{_RACY_KV}: 8 KV slots (39 in run18c)",
    ("gpu_serve_h100_run18b_300req.json", "easerve:e1p0d1:b6:s0+mps85"): f"{_RACY_KV}: 8 KV slots (39 in run18c)",
    ("gpu_serve_h100_run18b_300req.json", "easerve:e1p0d1:b1:s0+mps85"): f"{_RACY_KV}: its KV slots are not "
    "on record (its decode batches reached 17-32 rows; 39 slots in run18d)",
    **{("gpu_serve_h100_run34d_300req.json", s): "a probe: served with the H200's profile (the door sized "
       "for another card's capacity, as runs up to 32 were), not the run's setup" for s in
       ("easerve:e1p1d1:b1:s1+mps85", "dynamo-style:e1p1d1+mps85")},
}
"""Points on record that measured something else, by (file, system), with why. They stay in their
raw file; the summary leaves them out and lists them under ``excluded``."""


CURRENT_RUNS = "run14,run15,run17"
"""The committed runs of today's setup (one H200, the stages under MPS caps, the same serving code
but for the partition wake-up and the pools' rotation starts): what ``--summary`` reads by default
from ``benchmarks/results``. A later run only of plans and repeats (run 17) alone would compare a
few systems at one rate."""


def run_files(run: str | None, results: Path = RESULTS) -> tuple[str, list[Path]]:
    """The parts of ``run`` (default: ``CURRENT_RUNS`` in the committed results, else the newest run
    with 300-request points); ``run14,run15`` merges the parts of several runs of the same code and
    setup."""
    found: dict[str, list[Path]] = {}
    for f in sorted(f for pat in PATTERNS for f in glob.glob(str(results / pat))):
        m = _RUN.search(f)
        if m:
            found.setdefault(m.group(1) or m.group(3), []).append(Path(f))
    if not found:
        raise SystemExit(f"no {' or '.join(PATTERNS)} under {results}")
    current = results.resolve() == RESULTS.resolve() and all(r in found for r in CURRENT_RUNS.split(","))
    name = run or (CURRENT_RUNS if current else max(found, key=lambda r: int(r[3:])))
    missing = [r for r in name.split(",") if r not in found]
    if missing:
        raise SystemExit(f"--run {','.join(missing)}: runs on record are {', '.join(sorted(found))}")
    return name, [f for r in name.split(",") for f in found[r]]


def merge(run: str, files: list[Path]) -> dict[str, Any]:
    """One summary over the parts of a run: every system's points, whichever part measured them; a
    point measured in several parts is the mean of its repeats (``gpu_serve.mean_of_repeats``)."""
    repeats: dict[str, dict[float, list[dict[str, Any]]]] = {}
    parts: dict[str, list[str]] = {}
    meta: dict[str, Any] = {"run": run, "files": [str(f.relative_to(REPO)) if f.is_relative_to(REPO) else str(f)
                                                  for f in files]}
    for f in files:
        res = json.loads(f.read_text())
        for k in ("model", "gpu", "host_gpus", "mps", "requests_per_point", "slo_scale"):
            meta.setdefault(k, res.get(k))
        for name, s in res.get("systems", {}).items():
            if (why := EXCLUDED.get((f.name, name))) is not None:
                meta.setdefault("excluded", []).append({"file": f.name, "system": name, "why": why})
                continue
            for p in s.get("points", []):
                repeats.setdefault(name, {}).setdefault(p["rate"], []).append({**p, "file": f.name})
                parts.setdefault(name, []).append(f"{f.name}@{p['rate']}")
    points = {n: {r: gpu_serve.mean_of_repeats(ps) for r, ps in by_rate.items()} for n, by_rate in repeats.items()}
    merged = {"systems": {n: {"points": list(ps.values())} for n, ps in points.items() if ps}}
    systems = {n: s | {"parts": parts[n]} for n, s in gpu_serve.summarize([merged])["runs"][0]["systems"].items()}
    for n, by_rate in points.items():  # each repeat's moderate goodput beside the mean
        reps = {str(r): [x["goodput_moderate"] for x in p["repeats"]] for r, p in by_rate.items() if "repeats" in p}
        if reps:
            systems[n]["repeats_moderate"] = reps
    rates = sorted({float(r) for s in systems.values() for r in s["throughput"]})
    out: dict[str, Any] = meta | {"rates": rates, "systems": systems}
    ours = [n for n in systems if base_of(n) in EASERVE]  # its fixed layouts and points of HAS's space
    if not ours:
        return out | {"ratios": {}}

    def moderate(name: str, rate: float) -> float | None:  # unrounded, from the raw point
        p = points[name].get(rate)
        return gpu_serve.goodput_of(p, "moderate") if p else None

    def best(name: str) -> float:
        return max(gpu_serve.goodput_of(p, "moderate") for p in points[name].values())

    def configs(base: str) -> list[str]:
        """A baseline's measured configurations (``aggregated``, ``aggregated@4096``, ``dynamo-style:e1p2d1``, ...)."""
        return [n for n in systems if base_of(n) == base]

    best_ours = max(ours, key=best)
    ratios: dict[str, Any] = {"easerve_layout": best_ours}
    swept: dict[str, Any] = {}
    for base in (b for b in BASELINES if configs(b)):
        cfgs = configs(base)
        top = max(cfgs, key=best)
        swept[base] = {"configurations": cfgs, "best_over_rates": top,
                       "best_per_rate": {str(r): max((c for c in cfgs if moderate(c, r) is not None),
                                                     key=lambda c, r=r: moderate(c, r) or 0.0)
                                         for r in rates if any(moderate(c, r) is not None for c in cfgs)}}
        ratios[f"best_over_rates easerve/{base}"] = round(best(best_ours) / best(top), 2) if best(top) else None
        per_rate = {}
        for r in rates:
            ours_r = [v for n in ours if (v := moderate(n, r)) is not None]
            theirs = [v for c in cfgs if (v := moderate(c, r)) is not None]
            if ours_r and theirs and max(theirs):
                per_rate[str(r)] = round(max(ours_r) / max(theirs), 2)
        ratios[f"per_rate easerve/{base}"] = per_rate
    out["baselines_swept"] = swept
    return out | {"ratios": ratios}


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = ("strict", "tight", "moderate", "loose")
    # one line style and marker per family, so that more systems than colours stay apart
    style = {"easerve": ("-", "o"), "dynamo-style": ("--", "s"), "aggregated": (":", "^")}
    fig, axes = plt.subplots(1, len(tiers), figsize=(4.2 * len(tiers), 3.6), sharey=False)
    for ax, tier in zip(axes, tiers, strict=True):
        for name, s in summary["systems"].items():
            pts = sorted((float(r), g) for r, g in s["goodput"].get(tier, {}).items())
            ls, mk = style.get("easerve" if base_of(name) in EASERVE else base_of(name), ("-.", "x"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk, label=name)
        ax.set(title=f"{tier} tier", xlabel="offered rate (req/s)", ylabel="goodput (req/s)")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"{summary['run']}: {summary.get('model')} on {summary.get('gpu')} x{summary.get('host_gpus')}, "
                 f"{summary.get('requests_per_point')} requests a point (measured)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", action="store_true", help="merge the committed parts of one run; no GPU")
    ap.add_argument("--run", default=None, help="which run (runN, or runN,runM to merge runs of the same code); default the current setup's runs")
    ap.add_argument("--plot", default=None, help="with --summary: write the goodput-per-tier plot here")
    ap.add_argument("--results", default=str(RESULTS), help="with --summary: where the runs' JSON files are")
    args, rest = ap.parse_known_args(argv)
    if args.summary:
        name, files = run_files(args.run, Path(args.results))
        summary = merge(name, files)
        if args.plot:
            plot(summary, Path(args.plot))
        print(json.dumps(summary, indent=1))
        return 0
    sys.argv = [sys.argv[0], "--requests", "300", *rest]  # a sweep point is 300 requests (issue 17)
    return gpu_serve.main()


if __name__ == "__main__":
    sys.exit(main())
