"""`easerve calibrate-slo`: measure each omni class's solo p95 first response and write the SLO table.

HorizonServe's SLOs are ``Delta_c = solo_p95(c) * m_c`` (§4.2): a class's p95 first-response
latency when it runs *alone* on the target GPU, times a policy multiplier. This command sends
each class's requests one at a time (so no request ever queues behind another) to a running
omni server, streams each reply and times the first event (the first token, audio chunk or
image) on the client's clock, then writes the table JSON that the omni worker loads with
``--slo-table`` / ``$EASERVE_OMNI_SLO_TABLE``: recalibrating needs no rebuild.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

HELP = "Measure per-class solo p95 first-response latency against a running omni server; write the SLO table."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", required=True, help="Base URL of the omni server, e.g. http://localhost:8000"
    )
    parser.add_argument(
        "-f", "--file", required=True, help="EPDDeployment manifest (spec.mode: omni-colocated)"
    )
    parser.add_argument("--out", default=None, help="Write the SLO table JSON here (default: stdout)")
    parser.add_argument("--requests", type=int, default=20, help="Solo requests per class (default 20)")
    parser.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout, seconds")


def first_response_s(url: str, body: dict[str, Any], timeout: float) -> float:
    """Client-side time from sending the request to the first streamed event."""
    import urllib.request

    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            if line.startswith(b"data:"):
                t = time.perf_counter() - t0
                for _ in resp:  # drain to completion so the next request runs alone
                    pass
                return t
    raise RuntimeError("the server closed the stream without an event")


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * 0.95
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run(args: argparse.Namespace) -> int:
    from easerve_runtime.api import load_manifest
    from easerve_runtime.policies.omni import SLOTable, class_table

    name, spec = load_manifest(args.file)
    if spec.omni is None:
        print(
            f"easerve calibrate-slo: {args.file}: spec.omni is required (spec.mode: omni-colocated)",
            file=sys.stderr,
        )
        return 2
    if args.requests < 1:
        print("easerve calibrate-slo: --requests must be >= 1", file=sys.stderr)
        return 2
    solo: dict[str, float] = {}
    for cls, info in class_table(spec.omni.classes).items():
        body = {
            "model": spec.served_model_name,
            "priority": info.priority,
            "messages": [{"role": "user", "content": f"calibration request for class {cls}"}],
        }
        lat = []
        for _ in range(args.requests):
            try:
                lat.append(first_response_s(args.url, body, args.timeout))
            except OSError as exc:
                print(f"easerve calibrate-slo: {args.url}: {exc}", file=sys.stderr)
                return 1
        solo[cls] = p95(lat)
        print(f"{cls}: solo p95 {solo[cls]:.4f}s over {len(lat)} requests", file=sys.stderr)
    table = SLOTable.from_spec(spec.omni, solo)
    text = table.to_json()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        print(f"{name}: wrote SLO table to {args.out}: {table.as_dict()}", file=sys.stderr)
    else:
        print(text)
    return 0
