"""`easerve model init`: write a random model directory (HF layout) that the torch engine serves.

See ``easerve_runtime.models.init`` for what is written and why; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json

from easerve_runtime.models import ARCHS

HELP = "Model directories: 'init' writes a tiny (or full-size, config-only) random model that transformers loads."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = sub.add_parser("init", help="write a random model directory (config, weights, tokenizer, processor)")
    p.add_argument("--arch", required=True, choices=ARCHS, help="architecture (transformers' own classes)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_const", const="tiny", dest="size", help="a few MB, with weights")
    size.add_argument(
        "--size", choices=("tiny", "7b", "34b"), dest="size",
        help="preset; 7b/34b write the full-size config only (serve them with spec.model.randomWeights: true)",
    )
    p.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None,
                   help="save random weights too (default: only for tiny)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    p.add_argument("-o", "--out", required=True, help="output directory")
    parser.set_defaults(size="tiny")


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.models.init import init_model

    try:
        out = init_model(args.arch, args.out, size=args.size or "tiny", seed=args.seed, weights=args.weights)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(json.dumps({"arch": args.arch, "size": args.size or "tiny", "path": str(out)}))
    return 0
