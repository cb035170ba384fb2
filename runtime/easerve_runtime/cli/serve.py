"""`easerve serve -f FILE`: run an EPDDeployment locally (sim engine, file discovery)."""

from __future__ import annotations

import argparse
import logging
import sys

HELP = "Run an EPDDeployment file locally: frontend + encode/prefill/decode worker processes."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="EPDDeployment manifest (YAML).")
    parser.add_argument("--port", type=int, default=8000, help="Frontend port on 127.0.0.1 (default 8000).")
    parser.add_argument(
        "--workdir", default=None, help="Config, discovery dir, logs, processes.json (default: a temp dir)."
    )
    parser.add_argument(
        "--mps-share",
        default=None,
        help="stage=percent,... : under an MPS daemon (CUDA_MPS_PIPE_DIRECTORY), cap each named stage's "
        "processes at that share of the SMs, e.g. encode=85,local-prefill=85,prefill=85 when the pods share "
        "one GPU (decode left uncapped). Sets EASERVE_MPS_SHARES; docs/engine.md, 'Pods that share a GPU'.",
    )


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.workers.launcher import serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s serve %(levelname)s: %(message)s", stream=sys.stderr
    )
    from pydantic import ValidationError

    from easerve_runtime.api import spec_errors
    from easerve_runtime.workers.launcher import MPS_SHARES_ENV, mps_shares

    env: dict[str, str] = {}
    if args.mps_share is not None:
        try:
            mps_shares(args.mps_share)
        except ValueError as exc:
            print(f"easerve serve: --mps-share: {exc}", file=sys.stderr)
            return 2
        env[MPS_SHARES_ENV] = args.mps_share
    try:
        return serve(args.file, args.port, args.workdir, env=env)
    except ValidationError as exc:
        print(f"easerve serve: {args.file}:\n  " + "\n  ".join(spec_errors(exc)), file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"easerve serve: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="easerve serve", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
