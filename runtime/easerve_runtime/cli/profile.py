"""``easerve profile --engine torch -f SPEC -o PROFILE``: measure the engine, write a profile file.

The file is in the schema the twin reads (``profiles.schema.ProfileFileDoc``): point a spec at it
with ``spec.engine.profileFile`` and HAS, the twin and the sim engine use what this machine's
engine measured (``workers.engine_profile``; docs/profiles.md, "Profiles measured on an engine").
Progress goes to stderr; the last line of stdout is one JSON report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "Measure the deployment's engine stage by stage and write a profile file the twin reads."


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, choices=["torch"],
                        help="The engine to measure (torch: the transformers engine the pods run).")
    parser.add_argument("-f", "--spec", required=True, help="EPDDeployment manifest (spec.model.path: the model).")
    parser.add_argument("-o", "--out", required=True, help="Profile file to write (JSON).")
    parser.add_argument("--gpu", default=None,
                        help="GPU entry the profile names (<model>@<gpu>); default: the spec's current profile's.")
    parser.add_argument("--encode-batches", type=_ints, default=[1, 2, 4, 8, 16], help="Encode micro-batch sizes.")
    parser.add_argument("--decode-batches", type=_ints, default=[1, 4, 16, 32], help="Decode batch sizes.")
    parser.add_argument("--requests", type=int, default=16, help="Prompts to prefill (and requests sampled).")
    parser.add_argument("--reps", type=int, default=3, help="Timed repetitions per encode point (x4 decode steps).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed.")
    parser.add_argument("--image-format", choices=["png", "jpeg"], default="png",
                        help="How the sample's images are sent (as easerve bench --image-format; JPEG takes nvJPEG).")
    parser.add_argument("--stages", default="encode,prefill,decode",  # workers.engine_profile.STAGES
                        help="Stages to time (comma-separated; the rest of the file's stages stay the model's).")


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.api import Backend
    from easerve_runtime.cli.manifest import load_spec
    from easerve_runtime.workers.engine_profile import STAGES

    spec = load_spec(args.spec, "easerve profile")
    if spec is None:
        return 2
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    if not stages or set(stages) - set(STAGES):
        print(f"easerve profile: --stages: some of {', '.join(STAGES)}, got {args.stages!r}", file=sys.stderr)
        return 2
    if args.requests < 1 or args.reps < 1:
        print("easerve profile: --requests and --reps must be >= 1", file=sys.stderr)
        return 2
    if str(spec.engine.backend) != Backend.TORCH or not spec.model.path:
        print(f"easerve profile: {args.spec}: spec.engine.backend must be torch with spec.model.path set "
              f"(got backend {spec.engine.backend}, path {spec.model.path!r})", file=sys.stderr)
        return 2
    from easerve_runtime.profiles import ProfileFileError
    from easerve_runtime.workers.engine_profile import run as measure

    def progress(msg: str) -> None:
        print(f"[easerve profile] {msg}", file=sys.stderr, flush=True)

    try:
        report = measure(spec, Path(args.out), gpu=args.gpu, progress=progress,
                         encode_batches=args.encode_batches, decode_batches=args.decode_batches,
                         requests=args.requests, reps=args.reps, seed=args.seed, stages=stages,
                         image_format=args.image_format)
    except ProfileFileError as exc:
        print(f"easerve profile: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report), flush=True)
    return 0
