"""``easerve profile-stage``: HAS Stage 1 on this machine's engine, for one stage kind (a profiling Job).

The operator runs one such Job per stage kind (encode, prefill, decode) on GPUs of its own when a
search's trials run on the cluster (``spec.tuning.trials: cluster``), and reads the JSON report
from the Job's log (``workers.stage_profile``). Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

HELP = "Measure one stage's capacity on this machine's engine (HAS Stage 1; what a profiling Job runs)."


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", "-f", required=True, help="EPDDeployment manifest (the deployment to profile).")
    parser.add_argument("--stage", required=True, choices=["encode", "prefill", "decode"])
    parser.add_argument("--tp", type=_ints, default=[1], help="TP degrees to profile (prefill, decode), e.g. 2,4,8.")
    parser.add_argument("--max-batch", type=int, default=16, help="Encode: double B from 1 up to this.")
    parser.add_argument(
        "--local-shares", type=_floats, default=[],
        help="Prefill: also measure the local prefill worker at these SM shares (for alpha).",
    )
    parser.add_argument("--requests", type=int, default=256, help="Sample size (the twin profiler's: 256).")
    parser.add_argument("--seed", type=int, default=0, help="Sample seed (the twin profiler's: 0).")


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.cli.manifest import load_spec
    from easerve_runtime.workers.stage_profile import profile

    spec = load_spec(args.spec, "easerve profile-stage")
    if spec is None:
        return 2
    if args.max_batch < 1 or args.requests < 1 or any(t < 1 for t in args.tp):
        print("easerve profile-stage: --max-batch, --requests and --tp must be >= 1", file=sys.stderr)
        return 2
    report = asyncio.run(
        profile(spec, args.stage, tps=args.tp, max_batch=args.max_batch, local_shares=args.local_shares,
                requests=args.requests, seed=args.seed)
    )
    print(json.dumps(report), flush=True)
    return 0
