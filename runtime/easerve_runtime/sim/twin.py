"""The disaggregated EPD pipeline in virtual time: build the workers a spec describes, replay.

``run_pipeline`` wires encode workers (each with its own batcher from ``make_batcher`` and, when
``offload.ratio < 1``, a local prefill worker on its GPU and its own ``DeficitRouter``), remote
prefill workers and decode workers exactly as the runtime does, then replays a request list.
The frontend spreads arrivals over encode workers by fewest outstanding (``LeastOutstanding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.policies.batcher import Batcher, make_batcher
from easerve_runtime.policies.post_encode import PostEncodeRouter
from easerve_runtime.policies.router import LeastOutstanding
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.shares import ShareModel
from easerve_runtime.sim.stages import DecodeWorker, EncodeWorker, Job, KVHandoff, PrefillWorker
from easerve_runtime.workload.request import Request


def local_prefill_tp(spec: EPDDeploymentSpec, model: StageModel) -> int:
    """TP of a local prefill worker: the backbone must fit in the encode GPUs it spans.

    On a 48 GB GPU a 27–34B backbone needs two GPUs, so one local worker spans two encode GPUs
    (each giving it its complementary SM share); with fewer encode GPUs than that, local prefill
    is impossible and the spec is rejected rather than silently simulated.
    """
    tp = model.min_tp()
    if spec.allocation.encode.replicas < tp:
        raise ValueError(
            f"spec.offload.ratio: {spec.offload.ratio} < 1 needs a local prefill worker, but the backbone "
            f"needs {tp} GPUs (TP{tp}) and spec.allocation.encode.replicas is {spec.allocation.encode.replicas}"
        )
    return tp


def run_pipeline(
    spec: EPDDeploymentSpec,
    requests: Sequence[Request],
    model: StageModel,
    batcher_factory: Any = None,
) -> tuple[list[Job], dict[str, Any]]:
    """Replay ``requests`` through the pipeline ``spec`` describes; returns jobs and run stats.

    ``batcher_factory()`` overrides the spec's batcher (the Dynamo baseline passes a B = 1 eager
    batcher); by default every encode worker gets ``make_batcher(spec.encode)``.
    """
    a = spec.allocation
    loop = EventLoop()
    decoders = [
        DecodeWorker(
            loop,
            model,
            a.decode.tensor_parallel,
            f"decode-{i}",
            spec.decode.max_sequences,
            spec.decode.kv_memory_fraction,
        )
        for i in range(a.decode.replicas)
    ]
    budget = spec.prefill.max_batch_tokens
    handoff = KVHandoff(loop, model, decoders)
    remote = [
        PrefillWorker(loop, model, a.prefill.tensor_parallel, f"prefill-{i}", handoff, token_budget=budget)
        for i in range(a.prefill.replicas)
    ]
    s = float(spec.offload.ratio)
    colocated = spec.has_local_prefill
    if not remote and s > 0:
        raise ValueError(
            "spec.allocation.prefill.replicas: 0 remote prefill workers but spec.offload.ratio > 0"
        )
    shares = ShareModel(spec, model, colocated)
    reasons: dict[str, int] = {}
    encoders: list[EncodeWorker] = []
    locals_: list[PrefillWorker] = []
    local_tp = local_prefill_tp(spec, model) if colocated else 1
    hosts = (a.encode.replicas // local_tp) * local_tp if colocated else 0
    if colocated and hosts < a.encode.replicas and not remote:
        raise ValueError(
            f"spec.allocation.encode.replicas: {a.encode.replicas} encode GPUs do not divide into local prefill "
            f"workers of TP{local_tp}, and with no remote prefill workers the rest could not prefill"
        )
    for i in range(a.encode.replicas):
        local: PrefillWorker | None = None
        # a local worker of TP k spans k encode GPUs; leftover GPUs (n_E mod k) host none
        if i < hosts:
            if i % local_tp == 0:
                locals_.append(
                    PrefillWorker(
                        loop,
                        model,
                        local_tp,
                        f"local-{i // local_tp}",
                        handoff,
                        local=True,
                        token_budget=budget,
                    )
                )
            local = locals_[-1]
        batcher: Batcher[Any] = (
            batcher_factory() if batcher_factory is not None else make_batcher(spec.encode)
        )
        router: PostEncodeRouter[str] = PostEncodeRouter(s if local is not None else 1.0, local is not None)
        encoders.append(
            EncodeWorker(
                loop,
                model,
                shares,
                batcher,
                f"encode-{i}",
                router,
                remote,
                local,
                reasons,
                member=i % local_tp,
                send_window=spec.encode.send_window,
            )
        )

    jobs = [Job(r) for r in requests]
    picker = LeastOutstanding()
    names = [e.name for e in encoders]
    by_name = {e.name: e for e in encoders}
    outstanding = {n: 0 for n in names}

    def arrive(job: Job) -> None:
        for e in encoders:
            outstanding[e.name] = e.outstanding
        by_name[picker.pick(names, outstanding)].on_arrival(job)

    for job in jobs:
        loop.at(job.req.arrival_s, arrive, job)
    loop.run()

    horizon = max((j.rec.finish_s or 0.0) for j in jobs) - min((j.req.arrival_s for j in jobs), default=0.0)

    def util(ws: Sequence[Any]) -> float | None:
        if not ws or horizon <= 0:
            return None
        return sum(w.busy_s for w in ws) / (len(ws) * horizon)

    enc_batches = sum(e.batches for e in encoders)
    stats: dict[str, Any] = {
        "utilisation": {
            "encode": util(encoders),
            "local_prefill": util(locals_),
            "prefill": util(remote),
            "decode": util(decoders),
        },
        "dispatch_reasons": dict(sorted(reasons.items())),
        "routed": {
            "remote": sum(e.routed["remote"] for e in encoders),
            "local": sum(e.routed["local"] for e in encoders),
        },
        "encode_batches": enc_batches,
        "mean_encode_batch": (sum(e.batch_sum for e in encoders) / enc_batches) if enc_batches else 0.0,
        "embedding_transfers": sum(e.transfers for e in encoders),
        "embedding_bytes": sum(e.transfer_bytes for e in encoders),
        "prefill_batches": sum(p.batches for p in remote + locals_),
        "encoded_items": sum(e.items_sum for e in encoders),
        "prefilled_tokens": sum(p.tokens_sum for p in remote + locals_),
        "decoded_tokens": sum(d.batch_sum for d in decoders),
        "decode_steps": sum(d.steps for d in decoders),
        "mean_decode_batch": (sum(d.batch_sum for d in decoders) / max(1, sum(d.steps for d in decoders))),
        "encode_sm_levels": dict(sorted(shares.splits.items())),
        "events": loop.events,
    }
    return jobs, stats
