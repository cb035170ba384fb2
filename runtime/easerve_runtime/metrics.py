"""Every Prometheus metric of the runtime, defined once, with stable names (prefix ``easerve_``).

HAS and dashboards query these names, so renaming one is a breaking change: add a new metric
instead. Each process (frontend, encode, prefill, decode worker) registers all of them in its
own registry and updates the ones its stage owns; Prometheus adds the pod/stage labels from the
scrape target. Workers append this registry to Dynamo's system-status ``/metrics`` (port
``DYN_SYSTEM_PORT``); the frontend serves it on its HTTP port. ``docs/metrics.md`` lists them.

To add a metric: define it in :class:`Metrics` below, document it in ``docs/metrics.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "easerve"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
TTFT_BUCKETS = tuple(float(f"{2 ** (k / 8):.6g}") for k in range(-80, 57))
"""Time to first token: 2^(k/8) s from ~1 ms to 128 s, 9 % apart. HAS scores cluster trials from
this histogram (P99 within 10 % of the twin's, issue 13): factor-2 buckets resolved a percentile
only to a factor of 2; interpolation inside a 9 % bucket is off by a few % at most. Every power of
two (0.5, 1, 2, ... s) stays a boundary, so dashboards that pick ``le="1"`` keep working."""
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))

STAGES = ("frontend", "encode", "prefill", "local-prefill", "decode")


class Metrics:
    """The metric set of one process, in its own registry (tests can build several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        # Requests (frontend)
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Chat completion requests finished, by status (ok|error|rejected).",
            ["status"],
            registry=r,
        )
        self.received = Counter(
            f"{PREFIX}_requests_received",
            "Chat completion requests received, counted on arrival before admission (the offered load).",
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds", "Time to first token, seconds.", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            f"{PREFIX}_tpot_seconds",
            "Mean time per output token after the first, seconds.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_seconds",
            "End-to-end request latency, seconds.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            f"{PREFIX}_output_tokens", "Output tokens streamed to clients.", registry=r
        )
        # Encode
        self.encode_batch_size = Histogram(
            f"{PREFIX}_encode_batch_size",
            "Requests per encode micro-batch.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.encode_queue_wait = Histogram(
            f"{PREFIX}_encode_queue_wait_seconds",
            "Time a request waited in the encode batcher before its batch dispatched.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.encode_dispatch = Counter(
            f"{PREFIX}_encode_dispatch",
            "Encode micro-batch dispatches by reason (full|gap|max-age|timeout|eager).",
            ["reason"],
            registry=r,
        )
        self.goodput = Counter(
            f"{PREFIX}_goodput_requests",
            "Requests that met an SLO tier (their own TTFT and TPOT within the tier's bounds), by tier.",
            ["tier"],
            registry=r,
        )
        self.encode_sm_share = Gauge(
            f"{PREFIX}_partition_encode_sm_share",
            "SM fraction the encoder ran its last micro-batch on (1 without a local prefill partner).",
            registry=r,
        )
        self.encode_rate = Gauge(
            f"{PREFIX}_encode_arrival_rate",
            "The batcher's online arrival-rate estimate (requests/s).",
            registry=r,
        )
        self.encode_batch_bound = Gauge(
            f"{PREFIX}_encode_batch_bound",
            "B in force: the most requests per encode micro-batch (changes live, docs/adapt.md).",
            registry=r,
        )
        self.offload_ratio = Gauge(
            f"{PREFIX}_router_offload_ratio",
            "s in force: the fraction of prefills routed remote (changes live, docs/adapt.md).",
            registry=r,
        )
        self.knob_updates = Counter(
            f"{PREFIX}_knob_updates",
            "Live knob changes taken from the config file, by outcome (applied|refused|roll).",
            ["outcome"],
            registry=r,
        )
        self.encode_items = Counter(
            f"{PREFIX}_encode_items",
            "Encoder items (image crops, frame groups, audio windows) of the micro-batches, summed: with "
            "easerve_encode_batch_seconds the live cost of the encoder, which the autopilot calibrates its twin with.",
            registry=r,
        )
        self.encode_profile_seconds = Counter(
            f"{PREFIX}_encode_profile_seconds",
            "What the latency profile predicts for the micro-batches run (their items and SM share), summed: "
            "easerve_encode_batch_seconds_sum over it is how far the encoder is from its profile.",
            registry=r,
        )
        self.encode_seconds = Histogram(
            f"{PREFIX}_encode_batch_seconds",
            "Engine time per encode micro-batch.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        # Router
        self.routed = Counter(
            f"{PREFIX}_router_routed",
            "Prefill routing decisions by route (remote|local).",
            ["route"],
            registry=r,
        )
        self.deficit = Gauge(
            f"{PREFIX}_router_deficit", "The deficit router's accumulator d in [0, 1).", registry=r
        )
        # Envelopes
        self.envelope_bytes = Counter(
            f"{PREFIX}_envelope_bytes",
            "Embedding bytes sent in envelopes (payload, before encoding).",
            registry=r,
        )
        self.envelope_sends = Counter(
            f"{PREFIX}_envelope_sends", "Envelope sends (one per destination per micro-batch).", registry=r
        )
        self.envelope_in_flight = Gauge(
            f"{PREFIX}_envelope_in_flight",
            "Envelope sends in flight (bounded by the send window).",
            registry=r,
        )
        # Stages
        self.queue_depth = Gauge(
            f"{PREFIX}_stage_queue_depth",
            "Requests waiting for the stage's engine, per stage.",
            ["stage"],
            registry=r,
        )
        self.inflight = Gauge(
            f"{PREFIX}_stage_inflight",
            "Requests accepted and not yet finished, per stage.",
            ["stage"],
            registry=r,
        )
        self.stage_requests = Counter(
            f"{PREFIX}_stage_requests",
            "Requests handled per stage and outcome (ok|error|cancelled: the client went away before the stage ran it).",
            ["stage", "status"],
            registry=r,
        )
        # Prefill (remote and local, by stage): where a request's time between encode and its first
        # token goes, against the latency profile (as the encode counters above)
        self.prefill_batches = Counter(
            f"{PREFIX}_prefill_batches", "Prefill batches run.", ["stage"], registry=r
        )
        self.prefill_batch_requests = Counter(
            f"{PREFIX}_prefill_batch_requests", "Requests of the prefill batches run, summed.", ["stage"], registry=r
        )
        self.prefill_engine_seconds = Counter(
            f"{PREFIX}_prefill_engine_seconds", "Engine time of the prefill batches, summed.", ["stage"], registry=r
        )
        self.prefill_profile_seconds = Counter(
            f"{PREFIX}_prefill_profile_seconds",
            "What the latency profile predicts for the prefill batches run (their tokens, prompts, TP and SM "
            "share), summed: easerve_prefill_engine_seconds over it is how far prefill is from its profile.",
            ["stage"],
            registry=r,
        )
        self.prefill_queue_wait_seconds = Counter(
            f"{PREFIX}_prefill_queue_wait_seconds",
            "Time the batched requests waited in the prefill queue (received to batch taken), summed.",
            ["stage"],
            registry=r,
        )
        self.decode_batch_size = Histogram(
            f"{PREFIX}_decode_batch_size", "Sequences per decode step.", buckets=BATCH_BUCKETS, registry=r
        )

        self.kv_handoff_bytes = Counter(
            f"{PREFIX}_kv_handoff_bytes", "KV cache bytes sent from prefill to decode (torch engine).", registry=r
        )
        self.kv_handoff_seconds = Histogram(
            f"{PREFIX}_kv_handoff_seconds", "Time to move one request's KV cache to its decode worker.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r,
        )

    def exposition(self) -> str:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry).decode()


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus's ``histogram_quantile`` over cumulative bucket counts {upper bound: count}.

    The rank q·total falls in one bucket (lower, upper]; the estimate interpolates linearly
    inside it (the first bucket's lower bound is 0). A rank in the +Inf bucket returns the
    largest finite bound, as Prometheus does. NaN when the histogram is empty.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        raise ValueError("a histogram needs its +Inf bucket")
    counts = [buckets[b] for b in bounds]
    for i in range(1, len(counts)):  # monotone, as Prometheus enforces
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    i = next(k for k, c in enumerate(counts) if c >= rank)
    if math.isinf(bounds[i]):
        return bounds[-2] if len(bounds) > 1 else math.nan
    lower = 0.0 if i == 0 else bounds[i - 1]
    below = 0.0 if i == 0 else counts[i - 1]
    in_bucket = counts[i] - below
    if in_bucket <= 0:
        return bounds[i]
    return lower + (bounds[i] - lower) * (rank - below) / in_bucket


def observed_quantile(values: Iterable[float], q: float, bounds: Sequence[float] = TTFT_BUCKETS) -> float:
    """The ``q`` quantile of ``values`` as a scrape of one of our histograms reports it: the values
    counted into ``bounds`` (``le``), then ``histogram_quantile``. A prediction (the twin) passed
    through the measuring instrument compares like with like with a Prometheus figure."""
    vs = sorted(values)
    cum = {b: float(sum(1 for v in vs if v <= b)) for b in bounds}
    cum[math.inf] = float(len(vs))
    return histogram_quantile(q, cum)
