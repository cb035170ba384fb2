"""`easerve bench`: send a Poisson multimodal workload to a running endpoint and report."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Send a Poisson multimodal workload to an EAServe (or any OpenAI-compatible) endpoint."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="Base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--rate", type=float, default=2.0, help="Mean arrival rate, requests/s (default 2).")
    parser.add_argument("--requests", type=int, default=100, help="Number of requests (default 100).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default 0).")
    parser.add_argument(
        "--trace", default=None, help="Replay a JSONL trace instead of generating (workload format)."
    )
    parser.add_argument(
        "--spec", "-f", default=None, help="EPDDeployment file: its modality, and goodput per SLO tier."
    )
    parser.add_argument("--modality", default="image", choices=["image", "video", "audio", "text"])
    parser.add_argument(
        "--image-format", default="png", choices=["png", "jpeg"],
        help="png: a solid colour, no client CPU (default); jpeg: photo-like JPEGs, as real clients send "
        "(videos then go as JPEG frames, the form the torch engine serves, not as an mp4 container).",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="Ask for max_tokens tokens past any stop token (as vLLM's benchmark; random-weight models).",
    )
    parser.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"], help="Arrival process.")
    parser.add_argument("--cv", type=float, default=1.0, help="Coefficient of variation for gamma arrivals.")
    parser.add_argument(
        "--prompt-mean", type=int, default=None, help="Mean text prompt tokens (default 128)."
    )
    parser.add_argument("--output-mean", type=int, default=None, help="Mean output tokens (default 128).")
    parser.add_argument(
        "--range-ratio", type=float, default=None, help="Uniform +- ratio around the means (0.5)."
    )
    parser.add_argument("--model", default=None, help="Model name (default: the server's /v1/models).")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON only.")
    parser.add_argument(
        "--connection-per-request", action="store_true",
        help="Open a connection per request (independent users) instead of reusing a keep-alive pool; "
        "behind a Service that balances connections, this deals the requests themselves across its pods.",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Per-request limit, seconds; expired requests count as failed."
    )


def _fail(msg: str) -> int:
    print(f"easerve bench: {msg}", file=sys.stderr)
    return 2


def trace_rate(arrivals: list[float]) -> float | None:
    """The offered rate of a replayed trace: (n - 1) arrivals over the span from first to last.
    None for fewer than two requests or a zero span (no rate to speak of)."""
    if len(arrivals) < 2:
        return None
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else None


def workload_meta(args: argparse.Namespace, arrivals: list[float]) -> dict[str, object]:
    """What the report says about the offered load: the trace's own rate when one is replayed
    (``--rate`` and ``--seed`` played no part then), else the generator's parameters."""
    if args.trace:
        return {"rate": trace_rate(arrivals), "seed": None, "arrival": "trace", "trace": args.trace}
    return {"rate": args.rate, "seed": args.seed, "arrival": args.arrival}


def run(args: argparse.Namespace) -> int:
    import asyncio

    from easerve_runtime.bench.load import run_load
    from easerve_runtime.bench.report import report
    from easerve_runtime.workload import DEFAULT_TEXT, TextLengths, generate, generate_for, read_trace

    if args.requests < 1:
        return _fail(f"--requests must be >= 1, got {args.requests}")
    if not args.rate > 0:
        return _fail(f"--rate must be > 0, got {args.rate}")
    slo = None
    spec = None
    if args.spec:
        from pydantic import ValidationError

        from easerve_runtime.api import load_manifest, spec_errors

        try:
            _, spec = load_manifest(args.spec)
        except ValidationError as exc:
            return _fail(f"--spec {args.spec}: " + "; ".join(spec_errors(exc)))
        except (OSError, ValueError) as exc:
            return _fail(f"--spec {args.spec}: {exc}")
        slo = spec.slo
    text = TextLengths(
        prompt_mean=args.prompt_mean or DEFAULT_TEXT.prompt_mean,
        output_mean=args.output_mean or DEFAULT_TEXT.output_mean,
        range_ratio=DEFAULT_TEXT.range_ratio if args.range_ratio is None else args.range_ratio,
    )
    try:
        if args.trace:
            reqs = read_trace(args.trace)[: args.requests]
        elif spec is not None:
            reqs = generate(
                spec, args.rate, args.requests, args.seed, arrival=args.arrival, cv=args.cv, text=text
            )
        else:
            reqs = generate_for(
                args.modality,
                args.rate,
                args.requests,
                args.seed,
                arrival=args.arrival,
                cv=args.cv,
                text=text,
            )
    except (OSError, ValueError) as exc:
        return _fail(str(exc))

    show_bar = not args.json or sys.stdout.isatty()
    bar = None
    if show_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), unit="req", file=sys.stderr, desc="bench")

    def on_done(o: object) -> None:
        if bar is not None:
            bar.update(1)

    import time

    try:
        load = run_load(args.url, reqs, args.model, on_done, timeout_s=args.timeout, image_format=args.image_format,
                        ignore_eos=args.ignore_eos, connection_per_request=args.connection_per_request)
        outcomes, duration = asyncio.run(load)
        finished_at = time.time()
    except OSError as exc:
        return _fail(f"--url {args.url}: {exc}")
    finally:
        if bar is not None:
            bar.close()
    rep = report(outcomes, duration, slo)
    # wall-clock edges of the run (unix s): a scorer reading Prometheus uses the same window
    rep.update({"url": args.url, **workload_meta(args, [r.arrival_s for r in reqs])})
    rep.update({"started_at": finished_at - duration, "finished_at": finished_at})
    if args.json:
        print(json.dumps(rep, indent=1, sort_keys=True))
    else:
        keys = ("completed", "failed", "throughput", "ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99")
        for k in keys:
            print(f"{k:>12}: {rep.get(k)}")
        if "goodput" in rep:
            print(f"{'goodput':>12}: {rep['goodput']}")
    return 0 if rep["failed"] == 0 else 1
