"""The disaggregated EPD pipeline in virtual time: build the workers a spec describes, replay.

``run_pipeline`` builds one simulated worker per process of ``easerve_runtime.topology.plan`` --
the layout the pods and ``easerve serve`` run: per encode pod its encode workers (each with its
own batcher from ``make_batcher`` and, when ``offload.ratio < 1``, its own ``DeficitRouter``)
and the one local prefill worker of TP k they share; the prefill and decode pods' workers. Then
it replays a request list. With ``frontends`` (the deployment's admission control modelled), each
frontend spreads the requests it admitted over the encode workers as the live frontend does: by
the fewest of its own requests in flight at each (``LeastOutstanding`` over its own counts, held
until the request finishes). Without, one picker sees every encode worker's queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec, PartitionMode, SpecError, Stage
from easerve_runtime.policies.batcher import Batcher, make_batcher
from easerve_runtime.policies.post_encode import PostEncodeRouter
from easerve_runtime.policies.router import LeastOutstanding, spread_rotation_starts
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.frontdoor import FrontDoor
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.mpsshare import MPSSharing, prefill_pods
from easerve_runtime.sim.shares import ShareModel
from easerve_runtime.sim.stages import DecodeWorker, EncodeWorker, Job, KVHandoff, PrefillWorker
from easerve_runtime.sim.timeslice import TimeSlicing, placement, pod_key
from easerve_runtime.topology import Hardware, Process, Topology, plan
from easerve_runtime.workload.request import Request


def topology(spec: EPDDeploymentSpec, model: StageModel) -> Topology:
    """The deployment's layout, with the backbone's TP on this model's GPU for local prefill."""
    if not spec.has_local_prefill:
        return plan(spec, Hardware())
    return plan(spec, Hardware(local_prefill_tp=model.min_tp(), total_sms=model.total_sms or None))


@dataclass
class Control:
    """A controller that may change live knobs while the twin replays (segment replay).

    Every ``interval_s`` of virtual time from the first arrival until the last one,
    ``on_tick(now, jobs)`` sees every job so far (arrivals, finished records) and may return a
    ``policies.knobs.KnobChange``; every encode worker then takes it through the same
    ``apply_knobs`` the live workers use. What each worker applied or refused is in
    ``stats["knob_changes"]``.
    """

    interval_s: float
    on_tick: Callable[[float, Sequence[Job]], Any]


def run_pipeline(
    spec: EPDDeploymentSpec,
    requests: Sequence[Request],
    model: StageModel,
    batcher_factory: Any = None,
    control: Control | None = None,
    host_gpus: int | None = None,
    frontends: int = 0,
    mps_caps: Mapping[str, float] | None = None,
    frontend_starts: Sequence[int] | None = None,
    kv_ipc: bool = True,
    door_capacity_rps: float | None = None,
) -> tuple[list[Job], dict[str, Any]]:
    """Replay ``requests`` through the pipeline ``spec`` describes; returns jobs and run stats.

    ``batcher_factory()`` overrides the spec's batcher (the Dynamo baseline passes a B = 1 eager
    batcher); by default every encode worker gets ``make_batcher(spec.encode)``. ``host_gpus``:
    the deployment runs on one host with this many GPUs, placed as ``easerve serve`` places it,
    so processes on the same GPU time-slice it (``sim.timeslice``); None: GPUs of their own.
    ``frontends``: that many frontends admit the requests as the live ones do (``sim.frontdoor``:
    refused requests fail with the 429 reason); 0 (the default): every request is admitted.
    ``mps_caps`` (stage -> SM fraction): the processes that share a GPU run under MPS with these
    caps (``sim.mpsshare``) instead of time-slicing it, each encode pod's encode and local prefill
    unpartitioned (``smPartition.mode`` none), as the runtime serves them under MPS.
    ``frontend_starts``: each frontend's rotation start (one per frontend, as a live frontend draws
    it, ``process_rotation_start``); None: spread evenly (``spread_rotation_starts``).
    ``kv_ipc``: a KV handoff between two processes placed on the same GPU goes by CUDA IPC (the
    profile's ``kv_ipc`` transfer path), as the runtime hands it over by default (``engines.kv_ipc``);
    False: by the host, as with ``EASERVE_KV_IPC=0``. ``door_capacity_rps``: the deployment's
    saturation rate its frontends size their queues from (None: the spec's profile's, as live).
    """
    s = float(spec.offload.ratio)
    if spec.allocation.prefill.replicas == 0 and s > 0:
        raise SpecError(
            "spec.allocation.prefill.replicas", "0 remote prefill workers but spec.offload.ratio > 0"
        )
    topo = topology(spec, model)
    loop = EventLoop()
    devices = placement(topo, host_gpus)
    ts: TimeSlicing | MPSSharing | None = None
    if devices:
        ts = (MPSSharing(loop, devices, mps_caps, model, prefill_pods=prefill_pods(spec)) if mps_caps is not None
              else TimeSlicing(loop, devices))

    def each(stage: Stage) -> list[Process]:
        return [proc for pod, _ in topo.replicas() for proc in pod.process(stage)]

    def keys(stage: Stage) -> list[str]:
        """``each(stage)``'s pod replicas (the unit of time-slicing), in the same order."""
        return [pod_key(str(pod.stage), r) for pod, r in topo.replicas() for _ in pod.process(stage)]

    def sliced(worker: Any, key: str) -> Any:
        if ts is not None and key in devices:
            worker.ts, worker.proc = ts, key
        return worker

    decoders = [
        sliced(DecodeWorker(
            loop, model, p.tp, f"decode-{i}", spec.decode.max_sequences, spec.decode.kv_memory_fraction
        ), key)
        for i, (p, key) in enumerate(zip(each(Stage.DECODE), keys(Stage.DECODE), strict=True))
    ]
    budget = spec.prefill.max_batch_tokens

    def same_gpu(sender: str | None, decoder: str | None) -> bool:
        on = devices.get(sender or ""), devices.get(decoder or "")
        return on[0] is not None and on[0] == on[1] and len(on[0]) == 1

    handoff = KVHandoff(loop, model, decoders, same_gpu if kv_ipc and devices else None)
    remote = [
        sliced(PrefillWorker(loop, model, p.tp, f"prefill-{i}", handoff, token_budget=budget), key)
        for i, (p, key) in enumerate(zip(each(Stage.PREFILL), keys(Stage.PREFILL), strict=True))
    ]
    split_spec = spec
    if isinstance(ts, MPSSharing):
        # under MPS the encode process's green contexts are unavailable and the runtime serves its
        # encode and local prefill unpartitioned (run 14's logs): the split policy of mode none
        split_spec = spec.model_copy(update={"sm_partition": spec.sm_partition.model_copy(
            update={"mode": PartitionMode.NONE})})
    shares = ShareModel(split_spec, model, spec.has_local_prefill)
    reasons: dict[str, int] = {}
    encoders: list[EncodeWorker] = []
    locals_: list[PrefillWorker] = []
    for pod, replica in topo.replicas():
        if pod.stage != Stage.ENCODE:
            continue
        local: PrefillWorker | None = None
        for proc in pod.workers(Stage.LOCAL_PREFILL):  # its own process, or inside encode's (TP 1)
            tp = proc.tp if proc.stage == Stage.LOCAL_PREFILL else 1
            local = PrefillWorker(
                loop, model, tp, f"local-{len(locals_)}", handoff, local=True, token_budget=budget
            )
            sliced(local, pod_key(str(pod.stage), replica))
            locals_.append(local)
        for member, _proc in enumerate(pod.process(Stage.ENCODE)):
            batcher: Batcher[Any] = (
                batcher_factory() if batcher_factory is not None else make_batcher(spec.encode)
            )
            router: PostEncodeRouter[str] = PostEncodeRouter(s if local is not None else 1.0, local is not None)
            encoders.append(
                sliced(EncodeWorker(
                    loop,
                    model,
                    shares,
                    batcher,
                    f"encode-{len(encoders)}",
                    router,
                    remote,
                    local,
                    reasons,
                    member=member,  # this GPU's rank within its local prefill worker's TP group
                    send_window=spec.encode.send_window,
                ), pod_key(str(pod.stage), replica))
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

    door = FrontDoor(spec, frontends, host_gpus, door_capacity_rps) if frontends > 0 else None
    if door is None:
        for job in jobs:
            loop.at(job.req.arrival_s + model.request_path_s, arrive, job)
    else:
        handoff.on_first_token = door.first_token
        # each frontend picks the encode worker as the live one does (``workers.pool.Pool``): by the
        # fewest of *its own* requests in flight there (picked until the stream ends), its rotation
        # started at its own place, no two in step (``spread_rotation_starts``); it sees nothing of
        # the others'
        if frontend_starts is None:
            frontend_starts = spread_rotation_starts(len(names), frontends)
        elif len(frontend_starts) != frontends:
            raise ValueError(f"frontend_starts: need one start per frontend ({frontends}), got {len(frontend_starts)}")
        pickers = [LeastOutstanding(start) for start in frontend_starts]
        own: list[dict[str, int]] = [dict.fromkeys(names, 0) for _ in range(frontends)]
        sent: dict[int, tuple[int, str]] = {}

        def finished(job: Job) -> None:
            i, name = sent.pop(id(job))
            own[i][name] -= 1

        handoff.on_finish = finished

        def dispatch(job: Job) -> None:
            i = door.frontend(job)
            name = pickers[i].pick(names, own[i])
            own[i][name] += 1
            sent[id(job)] = (i, name)
            by_name[name].on_arrival(job)

        def knock(job: Job) -> None:
            if door.admit(job, loop.now):
                loop.at(loop.now + model.request_path_s, dispatch, job)

        for job in jobs:
            loop.at(job.req.arrival_s, knock, job)
    changes: list[dict[str, Any]] = []
    if control is not None and jobs:
        if not control.interval_s > 0:
            raise ValueError(f"Control.interval_s must be > 0, got {control.interval_s}")
        first, last = jobs[0].req.arrival_s, jobs[-1].req.arrival_s

        def tick(t: float) -> None:
            change = control.on_tick(t, jobs)
            if change is not None and change.live:
                results = [e.apply_knobs(change) for e in encoders]
                changes.append(
                    {
                        "at": t,
                        "applied": results[0].applied,
                        "refused": sorted({r for x in results for r in x.refused}),
                    }
                )
            if t + control.interval_s <= last:
                loop.at(t + control.interval_s, tick, t + control.interval_s)

        loop.at(first + control.interval_s, tick, first + control.interval_s)
    loop.run()

    horizon = max((j.rec.finish_s or 0.0) for j in jobs) - min((j.req.arrival_s for j in jobs), default=0.0)

    def util(ws: Sequence[Any]) -> float | None:
        if not ws or horizon <= 0:
            return None
        return sum(w.busy_s for w in ws) / (len(ws) * horizon)

    enc_batches = sum(e.batches for e in encoders)
    dec_steps = sum(d.steps for d in decoders)
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
        "encode_over_profile": (sum(e.busy_s for e in encoders) / prof) if (prof := sum(e.profile_s for e in encoders)) else None,
        # as the live counters read them (gpu_serve's encode / prefill rows): waits per request,
        # engine time per batch
        "encode_queue_wait_ms_mean": 1e3 * sum(e.wait_s for e in encoders) / max(1, sum(e.batch_sum for e in encoders)),
        "encode_ms_per_batch": 1e3 * sum(e.busy_s for e in encoders) / max(1, enc_batches),
        "prefill": {
            stage: {
                "batches": sum(p.batches for p in ws),
                "requests_per_batch": sum(p.requests_sum for p in ws) / max(1, sum(p.batches for p in ws)),
                "over_profile": (sum(p.busy_s for p in ws) / pp) if (pp := sum(p.profile_s for p in ws)) else None,
                "queue_wait_ms_mean": 1e3 * sum(p.wait_s for p in ws) / max(1, sum(p.requests_sum for p in ws)),
                "ms_per_batch": 1e3 * sum(p.busy_s for p in ws) / max(1, sum(p.batches for p in ws)),
            }
            for stage, ws in (("local-prefill", locals_), ("prefill", remote)) if ws
        },
        "embedding_transfers": sum(e.transfers for e in encoders),
        "embedding_bytes": sum(e.transfer_bytes for e in encoders),
        "prefill_batches": sum(p.batches for p in remote + locals_),
        "encoded_items": sum(e.items_sum for e in encoders),
        "prefilled_tokens": sum(p.tokens_sum for p in remote + locals_),
        "decoded_tokens": sum(d.batch_sum for d in decoders),
        "decode_steps": dec_steps,
        "mean_decode_batch": sum(d.batch_sum for d in decoders) / max(1, dec_steps),
        # as the decode loop's counters read it on the GPU (``decode_loop.loop_iteration_ms``)
        "decode_ms_per_step": 1e3 * sum(d.busy_s for d in decoders) / max(1, dec_steps),
        "encode_sm_levels": dict(sorted(shares.splits.items())),
        "events": loop.events,
    }
    if control is not None:
        stats["knob_changes"] = changes
    if door is not None:
        stats["admission"] = {"frontends": frontends, "bound": door.bound,
                              "capacity_rps": door.capacity_rps, "refused": door.refused}
    if ts is not None:
        stats["time_slicing" if mps_caps is None else "mps_sharing"] = {
            "host_gpus": host_gpus, "pods": {k: sorted(v) for k, v in devices.items()},
            "dispatches": ts.dispatches, "charged": ts.charged, **({"caps": dict(mps_caps)} if mps_caps else {})}
    return jobs, stats
