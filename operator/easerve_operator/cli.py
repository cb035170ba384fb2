"""The `easerve` command: a thin dispatcher over subcommand modules.

Each subcommand lives in its own module defining ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; heavy imports (kopf, torch, optuna, dynamo) happen inside ``run`` so
that ``easerve --help`` stays fast and a missing GPU stack never breaks unrelated commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# command name -> module implementing it
COMMANDS: dict[str, str] = {
    "crd": "easerve_operator.commands.crd",
    "render": "easerve_operator.commands.render",
    "operator": "easerve_operator.commands.operator",
    "up": "easerve_operator.commands.up",
    "tune": "easerve_operator.tuning.cli",
    "serve": "easerve_runtime.cli.serve",
    "worker": "easerve_runtime.cli.worker",
    "bench": "easerve_runtime.cli.bench",
    "sim": "easerve_runtime.cli.sim",
    "profile": "easerve_runtime.cli.profile",
    "profile-partition": "easerve_runtime.cli.profile_partition",
    "profile-stage": "easerve_runtime.cli.profile_stage",
    "partition-controller": "easerve_runtime.cli.partition_controller",
    "calibrate-slo": "easerve_runtime.cli.calibrate_slo",
    "model": "easerve_runtime.cli.model",
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None  # command not built into this installation
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="easerve", description="EAServe: encode-aware EPD serving for multimodal LLMs"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        mod = _load(module)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
