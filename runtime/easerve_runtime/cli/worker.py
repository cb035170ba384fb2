"""`easerve worker`: run one stage process (what each pod container runs).

The operator renders exactly ``easerve worker --stage <stage> --config /etc/easerve/config.json``;
keep this interface stable.
"""

from __future__ import annotations

import argparse
import logging
import sys

HELP = "Run one EAServe stage process (encode, prefill, decode, local-prefill, frontend, aggregated, omni-*)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stage",
        required=True,
        choices=[
            "encode",
            "prefill",
            "decode",
            "frontend",
            "local-prefill",
            "aggregated",
            "omni-shared",
            "omni-downstream",
        ],
        help="Stage to run (omni-* for spec.mode omni-colocated, aggregated for spec.mode aggregated).",
    )
    parser.add_argument("--config", required=True, help="RuntimeConfig JSON (the ConfigMap's config.json).")
    parser.add_argument("--host", default="0.0.0.0", help="Frontend bind address (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Frontend HTTP port (default 8000).")
    parser.add_argument(
        "--local-key",
        default=None,
        help="Pairs an encode worker with its local prefill worker (default: $POD_NAME or the hostname).",
    )
    parser.add_argument(
        "--discovery",
        choices=["etcd", "kubernetes", "file"],
        default=None,
        help="Override spec.discovery.backend (easerve serve uses file).",
    )
    parser.add_argument("--log-level", default="INFO", help="Python log level (default INFO).")


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.workers.main import run as run_worker

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s {args.stage} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_worker(
        args.stage,
        args.config,
        host=args.host,
        port=args.port,
        local_key=args.local_key,
        discovery=args.discovery,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="easerve worker", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
