"""Workloads: requests, arrivals, traces, and the metrics every run reports.

The discrete-event twin (`easerve_runtime.sim`) and the live load client (`easerve bench`)
both import from here, so a workload means the same thing, and is scored the same way, in
virtual and in real time. Nothing here uses asyncio.
"""

from easerve_runtime.workload.arrivals import ARRIVALS, arrival_times, interarrival_gaps
from easerve_runtime.workload.generate import DEFAULT_TEXT, TextLengths, draw_media, generate, generate_for
from easerve_runtime.workload.media import items_tokens
from easerve_runtime.workload.metrics import is_good, percentile, run_duration, summarize
from easerve_runtime.workload.request import Request, RequestRecord
from easerve_runtime.workload.trace import parse_request, read_trace, request_to_json, write_trace

__all__ = [
    "ARRIVALS",
    "DEFAULT_TEXT",
    "Request",
    "RequestRecord",
    "TextLengths",
    "arrival_times",
    "draw_media",
    "generate",
    "generate_for",
    "interarrival_gaps",
    "is_good",
    "items_tokens",
    "parse_request",
    "percentile",
    "read_trace",
    "request_to_json",
    "run_duration",
    "summarize",
    "write_trace",
]
