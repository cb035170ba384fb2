"""`easerve render -f FILE`: print the child objects the operator would create, as a YAML stream.

It runs the same pure renderer as the operator, so what you see is what gets applied. An
invalid spec exits 2 with one ``spec.field: message`` line per problem.
"""

from __future__ import annotations

import argparse
import sys

HELP = "render an EPDDeployment file into the child objects the operator creates (YAML stream)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="EPDDeployment manifest (YAML)")
    parser.add_argument(
        "-n", "--namespace", default=None, help="namespace (default: metadata.namespace or default)"
    )
    parser.add_argument(
        "--uid",
        default="00000000-0000-0000-0000-000000000000",
        help="owner UID written into ownerReferences (the real one is known only in-cluster)",
    )


def run(args: argparse.Namespace) -> int:
    import yaml
    from easerve_runtime.api import KIND, SpecError, parse_spec, spec_errors
    from easerve_runtime.profiles import profile_errors
    from pydantic import ValidationError

    from easerve_operator.render import render_children

    with open(args.file) as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d and d.get("kind") == KIND]
    if not docs:
        print(f"error: {args.file}: no {KIND} document", file=sys.stderr)
        return 2
    out = []
    for doc in docs:
        meta = doc.get("metadata") or {}
        try:
            spec = parse_spec(doc.get("spec") or {})
        except ValidationError as exc:
            for line in spec_errors(exc):
                print(f"error: {meta.get('name', '?')}: {line}", file=sys.stderr)
            return 2
        profile_errs = profile_errors(spec)  # e.g. spec.model.encoder against a shipped profile
        for err in profile_errs:
            print(f"error: {meta.get('name', '?')}: {err}", file=sys.stderr)
        if profile_errs:
            return 2
        ns = args.namespace or meta.get("namespace") or "default"
        try:
            out.extend(render_children(meta["name"], ns, args.uid, spec))
        except SpecError as exc:  # a layout rule that needs the latency profile
            print(f"error: {meta.get('name', '?')}: {exc}", file=sys.stderr)
            return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=120))
    return 0
