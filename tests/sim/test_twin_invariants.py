"""Twin invariants on a toy profile with round numbers (so latencies can be checked by hand)."""

from __future__ import annotations

import math

import pytest
from easerve_runtime.api import DispatchPolicy
from easerve_runtime.sim import SYSTEMS, simulate
from easerve_runtime.sim.systems import best_of, variant
from easerve_runtime.workload import Request, generate
from toy import ToyProfile


def with_encode(spec, **kw):
    return spec.model_copy(update={"encode": spec.encode.model_copy(update=kw)})


@pytest.mark.parametrize("system", SYSTEMS)
def test_no_request_lost_or_duplicated_and_work_is_conserved(system, llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 3.0, 300, seed=5)
    r = simulate(llava_spec, reqs, system, model=toy_model, sweep=False)
    ids = [x.id for x in r.records]
    assert sorted(ids) == sorted(q.id for q in reqs) and len(set(ids)) == len(ids)
    assert r.summary["completed"] == 300 and r.summary["failed"] == 0
    for rec in r.records:
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
    st = r.stats
    assert st["encoded_items"] == sum(q.encoder_items for q in reqs)
    assert st["prefilled_tokens"] == sum(q.prefill_tokens for q in reqs)
    assert st["decoded_tokens"] == sum(q.output_tokens - 1 for q in reqs)


def test_single_request_latency_is_the_sum_of_its_stage_latencies(llava_spec, toy_model) -> None:
    spec = variant(with_encode(llava_spec, dispatch=DispatchPolicy.EAGER), "easerve-s1")
    req = Request(
        id="one",
        arrival_s=1.0,
        modality="image",
        encoder_items=3,
        prompt_tokens=100,
        media_tokens=1176,
        output_tokens=5,
    )
    rec = simulate(spec, [req], "easerve", model=toy_model).records[0]
    p, tp = ToyProfile(), spec.allocation.prefill.tensor_parallel
    tokens = 1276
    ttft = p.encode_s(3) + p.transfer_s(p.embedding_bytes(1176)) + p.prefill_s(tokens, 1.0, tp=tp)
    assert rec.first_token_s - rec.arrival_s == pytest.approx(ttft, rel=1e-12)
    tpd = spec.allocation.decode.tensor_parallel
    decode = sum(p.decode_step_s(1, tokens + 1 + i, tp=tpd) for i in range(4))
    assert rec.finish_s - rec.first_token_s == pytest.approx(
        p.transfer_s(p.kv_bytes(tokens)) + decode, rel=1e-12
    )
    # the second token: the KV handoff, then decode's first step (what a live client times too)
    assert rec.token2_gap_s == pytest.approx(
        p.transfer_s(p.kv_bytes(tokens)) + p.decode_step_s(1, tokens + 1, tp=tpd), rel=1e-12
    )


def test_poisson_gap_single_request_waits_exactly_the_max_age_valve(llava_spec, toy_model) -> None:
    """With one arrival λ̂ is unknown, so the request leaves on the max-age valve: its only wait."""
    spec = variant(llava_spec, "easerve-s1")
    req = Request(
        id="one",
        arrival_s=0.0,
        modality="image",
        encoder_items=1,
        prompt_tokens=10,
        media_tokens=576,
        output_tokens=1,
    )
    r = simulate(spec, [req], "easerve", model=toy_model)
    p = ToyProfile()
    expect = (
        spec.encode.max_age_ms / 1e3
        + p.encode_s(1)
        + p.transfer_s(p.embedding_bytes(576))
        + p.prefill_s(586, 1.0, tp=2)
    )
    assert r.records[0].first_token_s == pytest.approx(expect, rel=1e-12)
    assert r.records[0].finish_s == r.records[0].first_token_s  # one output token: no decode
    assert r.dispatch_reasons == {"max-age": 1}


def test_seeded_runs_are_deterministic(llava_spec, toy_model) -> None:
    a = simulate(llava_spec, generate(llava_spec, 2.5, 200, seed=3), "easerve", model=toy_model)
    b = simulate(llava_spec, generate(llava_spec, 2.5, 200, seed=3), "easerve", model=toy_model)
    assert [(x.id, x.first_token_s, x.finish_s, x.route) for x in a.records] == [
        (x.id, x.first_token_s, x.finish_s, x.route) for x in b.records
    ]
    assert a.summary == b.summary and a.dispatch_reasons == b.dispatch_reasons


def test_deficit_router_split_and_envelopes(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 4.0, 400, seed=9)
    r = simulate(llava_spec, reqs, "easerve", model=toy_model)  # s = 0.5, 2 encode workers
    assert r.routed["remote"] + r.routed["local"] == 400
    assert abs(r.routed["remote"] - 200) <= llava_spec.allocation.encode.replicas  # ±1 per router
    assert {rec.route for rec in r.records} == {"remote", "local"}
    # envelope semantics: at most one remote transfer per micro-batch (one remote prefill worker)
    assert r.stats["embedding_transfers"] <= r.stats["encode_batches"]


def test_dynamo_encodes_one_request_per_pass_and_sends_one_transfer_each(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 3.0, 200, seed=1)
    r = simulate(llava_spec, reqs, "dynamo", model=toy_model, sweep=False)
    assert r.stats["encode_batches"] == 200 and r.stats["embedding_transfers"] == 200
    assert r.config["batch_bound"] == 1 and r.config["offload_ratio"] == 1.0
    assert r.routed == {"remote": 200, "local": 0}


def test_batching_forms_batches_under_load(llava_spec, toy_model) -> None:
    spec = with_encode(llava_spec, batch_bound=8, max_age_ms=200.0)
    r = simulate(spec, generate(spec, 40.0, 400, seed=2), "easerve-s1", model=toy_model)
    assert r.stats["mean_encode_batch"] > 1.5
    assert set(r.dispatch_reasons) <= {"full", "gap", "max-age"}


def test_best_of_is_a_real_sweep_and_returns_its_best(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 3.0, 150, seed=4)
    best = best_of(llava_spec, reqs, "dynamo", toy_model)
    assert len(best.swept) > 3
    tier = llava_spec.slo.objective
    assert best.summary["goodput"][tier] == max(s["goodput"] for s in best.swept)
    labels = {s["config"]["allocation"] for s in best.swept}
    assert len(labels) == len(best.swept)  # every allocation once
    agg = best_of(llava_spec, reqs, "aggregated", toy_model)
    assert {s["config"]["tp"] for s in agg.swept} >= {1, 2}


def test_sm_partition_modes_all_run_and_dynamic_levels_follow_the_batch(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 6.0, 200, seed=6)
    for mode in ("none", "static", "dynamic"):
        sp = llava_spec.model_copy(
            update={
                "sm_partition": llava_spec.sm_partition.model_copy(
                    update={"mode": mode, "static_encode_sms": 64}
                )
            }
        )
        r = simulate(sp, reqs, "easerve", model=toy_model)
        assert r.summary["completed"] == 200
        assert r.utilisation["local_prefill"] is not None and r.utilisation["local_prefill"] > 0
        if mode == "dynamic":
            assert r.stats["encode_sm_levels"] and all(0 < k <= 100 for k in r.stats["encode_sm_levels"])


def test_summary_metrics_are_finite(llava_spec, toy_model) -> None:
    r = simulate(llava_spec, generate(llava_spec, 1.0, 50, seed=0), "aggregated", model=toy_model)
    for k in ("throughput", "ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"):
        assert math.isfinite(r.summary[k])
    assert set(r.summary["goodput"]) == {t.name for t in llava_spec.slo.tiers}


def test_aggregated_chunked_prefill_conserves_work_and_first_token_waits_for_the_last_chunk(
    llava_spec, toy_model
) -> None:
    from easerve_runtime.sim.systems import simulate_system

    reqs = generate(llava_spec, 3.0, 120, seed=8)
    r = simulate_system(llava_spec, reqs, "aggregated", toy_model, layout=(2, 4, 512))
    assert r.config["token_budget"] == 512
    assert r.summary["completed"] == 120
    assert r.stats["prefilled_tokens"] == sum(q.prefill_tokens for q in reqs)
    assert r.stats["decoded_tokens"] == sum(q.output_tokens - 1 for q in reqs)
    # a lone request of 1276 tokens needs ceil(1276/512) = 3 iterations before its first token
    one = Request(
        id="x",
        arrival_s=0.0,
        modality="image",
        encoder_items=3,
        prompt_tokens=100,
        media_tokens=1176,
        output_tokens=1,
    )
    rec = simulate_system(llava_spec, [one], "aggregated", toy_model, layout=(2, 1, 512)).records[0]
    p = ToyProfile()
    expect = p.encode_s(2) + p.prefill_s(512, tp=2) * 2 + p.prefill_s(1276 - 1024, tp=2)
    assert rec.first_token_s == pytest.approx(expect, rel=1e-12)


def test_all_local_prefill_with_an_odd_encoder_count_is_rejected_naming_the_field(llava_spec) -> None:
    """Local prefill of a TP2 backbone on 3 encode GPUs leaves one GPU with nowhere to prefill."""
    from easerve_runtime.api import Allocation, StageAllocation
    from easerve_runtime.sim.runner import cached_model

    a = Allocation(
        encode=StageAllocation(replicas=3),
        prefill=StageAllocation(replicas=0),
        decode=StageAllocation(replicas=2, tensor_parallel=2),
    )
    spec = llava_spec.model_copy(
        update={"allocation": a, "offload": llava_spec.offload.model_copy(update={"ratio": 0.0})}
    )
    with pytest.raises(ValueError, match="spec.allocation.encode.replicas"):
        simulate(spec, generate(spec, 1.0, 5, seed=0), "easerve", model=cached_model(llava_spec))


def test_all_local_prefill_on_two_gpus_runs_without_a_remote_prefill_pool(llava_spec, toy_model) -> None:
    """E1 P0 D1 (a 2-GPU budget, s = 0): every prefill runs on the encode GPU's local worker."""
    from easerve_runtime.api import EPDDeploymentSpec

    raw = llava_spec.wire()
    raw["gpuBudget"] = 2
    raw["allocation"] = {"encode": {"replicas": 1}, "prefill": {"replicas": 0}, "decode": {"replicas": 1}}
    raw["offload"] = {"ratio": 0.0}
    spec = EPDDeploymentSpec.model_validate(raw)  # the spec's own rules admit it
    reqs = generate(spec, 1.0, 60, seed=4)
    r = simulate(spec, reqs, "easerve", model=toy_model, sweep=False)
    assert r.summary["completed"] == 60 and r.summary["failed"] == 0
    assert r.summary["goodput"][spec.slo.objective] > 0
    assert r.routed == {"remote": 0, "local": 60}
    assert r.utilisation["prefill"] is None and r.utilisation["local_prefill"] > 0
    assert r.stats["prefilled_tokens"] == sum(q.prefill_tokens for q in reqs)


def test_a_local_prefill_that_starts_paused_is_counted_at_the_share_it_then_runs_with(llava_spec) -> None:
    """``stats.prefill['local-prefill'].over_profile`` is the live counters' ``engine_over_profile``.

    A local batch that starts while its encoder holds every SM (the dynamic split's zero share)
    had its profile time counted at that share: infinite, so the ratio read 0.0. The live worker
    counts it at the share it is granted once it runs, and so does the twin now: the ratio is
    finite and at least 1 (pauses and smaller shares only slow a batch down)."""
    from easerve_operator.tuning.space import Alloc, Candidate, apply_candidate
    from easerve_runtime.sim.runner import cached_model
    from easerve_runtime.sim.systems import simulate_system

    assert str(llava_spec.sm_partition.mode) == "dynamic"
    spec = apply_candidate(llava_spec, Candidate(Alloc(6, 0, 2, 1, 2), 1, 0.0))  # every prefill local
    r = simulate_system(spec, generate(spec, 3.0, 300, seed=1), "easerve", cached_model(spec))
    local = r.stats["prefill"]["local-prefill"]
    assert local["batches"] > 0
    assert math.isfinite(local["over_profile"]) and local["over_profile"] >= 1.0
