"""Pods that share a GPU under MPS with per-stage SM caps (``sim.mpsshare``): the twin of
``easerve serve --mps-share``. A capped stage runs at its share's pace (the profile's SM curves);
decode, uncapped, pays a co-run term beside capped work (and, where a fit switches it on, more when
the caps in flight leave it less than it needs); any work beside another pod's pays the bandwidth
contention."""

from __future__ import annotations

import pytest
from easerve_runtime.sim import mpsshare, simulate_system
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.mpsshare import MPSSharing
from easerve_runtime.workload import generate

ONE_GPU = {"encode/0": frozenset({0}), "prefill/0": frozenset({0}), "decode/0": frozenset({0})}


def test_caps_set_each_stages_pace_and_decode_pays_only_for_what_they_leave(toy_model) -> None:
    loop = EventLoop()
    caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
    m = MPSSharing(loop, ONE_GPU, caps, toy_model, contention=0.1, decode_saturation=0.4, decode_corun=0.0)
    assert m.cap("encode/0") == 0.85 and m.cap("prefill/0") == 0.85 and m.cap("decode/0") is None
    assert m.dilation("decode/0", "decode") == 1.0  # alone and uncapped: its own pace
    alone = m.dilation("prefill/0", "prefill")
    assert alone == m.share_factor("prefill", 0.85) > 1.0  # capped even when alone
    m.occupy("prefill/0", 5.0)
    # one capped pod in flight leaves 15 % of the SMs: decode needs 40 % for its full pace
    assert m.dilation("decode/0", "decode") == pytest.approx((0.4 / 0.15) * 1.1)
    m.occupy("encode/0", 5.0)  # two caps in flight (1.7 > 1): decode is left the floor
    assert m.dilation("decode/0", "decode") == pytest.approx((0.4 / mpsshare.MIN_FREE) * 1.1)
    m.occupy("decode/0", 5.0)  # an oversubscribed pair splits the SMs in proportion to the caps
    assert m.dilation("prefill/0", "prefill") == pytest.approx(m.share_factor("prefill", 0.85 / 1.7) * 1.1)
    assert m.dilation("frontend/0", "") == 1.0  # not on a GPU
    loop.at(5.0, lambda: None)
    loop.run()
    assert m.dilation("decode/0", "decode") == 1.0  # everything in flight ended at 5.0


def test_a_wide_cap_leaves_decode_its_pace() -> None:
    """Caps that leave decode at least what it needs cost it only the contention."""
    loop = EventLoop()
    m = MPSSharing(loop, ONE_GPU, {"prefill": 0.5}, model=None, contention=0.1, decode_saturation=0.4,  # type: ignore[arg-type]
                   decode_corun=0.0)
    m.occupy("prefill/0", 1.0)
    assert m.dilation("decode/0", "decode") == pytest.approx(1.1)


def test_the_twin_serves_a_shared_gpu_under_caps_faster_than_time_sliced(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 2.0, 200, seed=11)
    caps = {"encode": 0.7, "local-prefill": 0.7, "prefill": 0.7}
    sliced = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=1)
    capped = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=1, mps_caps=caps)
    own = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=8, mps_caps=caps)
    st = capped.stats["mps_sharing"]
    assert st["caps"] == caps and 0 < st["charged"] <= st["dispatches"] and "time_slicing" not in capped.stats
    assert len(capped.records) == len(sliced.records) == len(reqs)  # nothing lost
    # first tokens come sooner: encode and prefill run beside decode instead of taking turns (on the
    # toy model decode's step pays about as much either way; on the H200 profile it is faster too)
    assert capped.summary["ttft_mean"] < sliced.summary["ttft_mean"]
    assert capped.summary["goodput"]["strict"] >= sliced.summary["goodput"]["strict"]
    assert "mps_sharing" not in own.stats  # GPUs of their own: nothing shared, caps or not


def test_two_uncapped_decode_pods_split_the_bandwidth() -> None:
    loop = EventLoop()
    devices = {"decode/0": frozenset({0}), "decode/1": frozenset({0})}
    m = MPSSharing(loop, devices, {"prefill": 0.5}, model=None, contention=0.1, decode_saturation=0.4)  # type: ignore[arg-type]
    m.occupy("decode/1", 1.0)
    assert m.dilation("decode/0", "decode") == pytest.approx(2 * 1.1)


def test_decode_beside_capped_work_pays_the_corun_whatever_the_caps() -> None:
    """Runs 14-15: the served decode step was 1.3-1.5x the profile's beside capped encode and
    prefill at 50 % and 85 % caps alike; the co-run term does not grow with the cap."""
    factors = []
    for cap in (0.5, 0.85):
        loop = EventLoop()
        m = MPSSharing(loop, ONE_GPU, {"prefill": cap}, model=None, contention=0.2,  # type: ignore[arg-type]
                       decode_saturation=mpsshare.MIN_FREE, decode_corun=0.7)
        assert m.dilation("decode/0", "decode") == 1.0  # alone: its own pace
        m.occupy("prefill/0", 1.0)
        factors.append(m.dilation("decode/0", "decode"))
    assert factors[0] == factors[1] == pytest.approx(1.7 * 1.2)
    loop = EventLoop()
    m = MPSSharing(loop, devices={"decode/0": frozenset({0}), "decode/1": frozenset({0})}, caps={},
                   model=None, contention=0.2, decode_corun=0.7)  # type: ignore[arg-type]
    m.occupy("decode/1", 1.0)  # an uncapped neighbour splits the bandwidth; the co-run is for capped work
    assert m.dilation("decode/0", "decode") == pytest.approx(2 * 1.2)


def test_the_calibrated_constants_switch_the_saturation_rule_off() -> None:
    """The fit on runs 14-15 set the saturation to the floor: two 85 % caps in flight together
    cost decode only the co-run and the contention."""
    loop = EventLoop()
    m = MPSSharing(loop, ONE_GPU, {"encode": 0.85, "prefill": 0.85}, model=None)  # type: ignore[arg-type]
    m.occupy("encode/0", 1.0)
    m.occupy("prefill/0", 1.0)
    assert m.dilation("decode/0", "decode") == pytest.approx((1 + mpsshare.DECODE_CORUN) * (1 + mpsshare.CONTENTION))



def test_an_encoder_batch_beside_other_work_pays_the_encode_co_run(toy_model) -> None:
    """Run 23's counters: on the H100 the served encoder beside decode took 1.3-1.8x what the twin
    charged from its cap's SM curve and the contention. ``encode_corun`` charges that: an encoder
    micro-batch dispatched while another pod has work in flight pays ``1 + encode_corun`` on top;
    alone it pays its cap only, and a capped prefill does not pay it."""
    loop = EventLoop()
    caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
    m = MPSSharing(loop, ONE_GPU, caps, toy_model, contention=0.1, decode_saturation=mpsshare.MIN_FREE,
                   decode_corun=0.0, encode_corun=0.5)
    alone = m.dilation("encode/0", "encode")
    assert alone == pytest.approx(m.share_factor("encode", 0.85))
    m.occupy("decode/0", 5.0)
    assert m.dilation("encode/0", "encode") == pytest.approx(alone * 1.5 * 1.1)
    assert m.dilation("prefill/0", "prefill") == pytest.approx(m.share_factor("prefill", 0.85) * 1.1)
    assert MPSSharing(EventLoop(), ONE_GPU, caps, toy_model).encode_corun == mpsshare.ENCODE_CORUN == 0.0


def test_the_h100_profiles_constants_leave_decodes_pace_to_the_co_run_not_the_cap() -> None:
    """Runs 22-23 on two H100 hosts: the served decode step beside capped work was the same under
    70 % and 85 % caps (Dynamo-style at 7 req/s 21.95 ms at 18.4 rows against 22.77 at 19.1; E1 P0
    D1 at 5.5 20.63 ms at 13.8 rows against 19.62 at 13.2), where the saturation rule the H100's
    first fit chose (0.4) charged decode 2x more under 85 %. The refit on runs 18-23 switched it
    off: the profile's constants make decode's factor beside capped work the same at every cap
    (and its per-row term, ``decode_row_ms``, the same too)."""
    from pathlib import Path

    from easerve_runtime.profiles.source import load_profile_file
    from easerve_runtime.sim.latency import StageModel

    h100 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine_profile_h100_llava7b_run20.json"
    model = StageModel(load_profile_file(h100))
    assert model.mps_constants is not None and model.mps_constants["decode_saturation"] == mpsshare.MIN_FREE
    factors = []
    for cap in (0.5, 0.7, 0.85):
        loop = EventLoop()
        m = MPSSharing(loop, ONE_GPU, {"encode": cap, "local-prefill": cap, "prefill": cap}, model)
        m.occupy("encode/0", 1.0)
        factors.append(m.dilation("decode/0", "decode"))
    c = model.mps_constants
    assert factors == pytest.approx([(1 + c["decode_corun"]) * (1 + c.get("decode_contention", c["contention"]))] * 3)
    rows = [MPSSharing(EventLoop(), ONE_GPU, {"encode": cap}, model).decode_rows_s("decode/0", 16) for cap in (0.5, 0.85)]
    assert rows[0] == rows[1] == pytest.approx(16 * c["decode_row_ms"] / 1e3) and rows[0] > 0


def test_the_twin_reports_the_encoders_time_over_the_profile_as_the_live_counters_do(llava_spec, toy_model) -> None:
    """``stats.encode_over_profile`` is the live ``engine_over_profile`` (the encode workers'
    counters, run 17 on): 1 on GPUs of their own, above 1 when the encoder shares its GPU with
    decode under MPS caps (the cap's SM curve and the contention)."""
    reqs = generate(llava_spec, 2.0, 120, seed=3)
    caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
    own = simulate_system(llava_spec, reqs, "easerve", toy_model)
    shared = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=1, mps_caps=caps)
    assert own.stats["encode_over_profile"] == pytest.approx(1.0)
    assert shared.stats["encode_over_profile"] > 1.0


def test_decode_beside_capped_pods_pays_per_row_whether_or_not_they_are_in_flight(toy_model) -> None:
    """Runs 18-26 on five H100 hosts: the served decode step minus the profile's grew 0.36-0.38 ms a
    row in every capped layout, its intercept the profile's, and the encode pod's busy share did not
    move it. ``decode_row_ms`` charges that per running sequence on a GPU that capped pods share;
    ``decode_contention`` (0 here) keeps the intercept off the contention."""
    loop = EventLoop()
    m = MPSSharing(loop, ONE_GPU, {"encode": 0.85, "prefill": 0.85}, toy_model, contention=0.3,
                   decode_saturation=mpsshare.MIN_FREE, decode_corun=0.0, decode_contention=0.0, decode_row_ms=0.4)
    assert m.decode_rows_s("decode/0", 10) == pytest.approx(0.004)  # nothing in flight: still paid
    assert m.dilation("decode/0", "decode") == 1.0
    m.occupy("prefill/0", 1.0)
    assert m.decode_rows_s("decode/0", 20) == pytest.approx(0.008)
    assert m.dilation("decode/0", "decode") == 1.0  # decode's contention 0: the intercept stays
    assert m.dilation("encode/0", "encode") > m.share_factor("encode", 0.85)  # the others' contention stays
    assert m.decode_rows_s("prefill/0", 20) == 0.0  # a capped pod pays its cap, not rows
    alone = MPSSharing(EventLoop(), {"decode/0": frozenset({0}), "prefill/0": frozenset({1})},
                       {"prefill": 0.85}, model=None, decode_row_ms=0.4)  # type: ignore[arg-type]
    assert alone.decode_rows_s("decode/0", 20) == 0.0  # no capped pod on its GPU
    assert MPSSharing(EventLoop(), ONE_GPU, {"prefill": 0.85}, model=None).decode_rows_s("decode/0", 20) == 0.0  # type: ignore[arg-type]
    # unset, decode's contention is the card's contention
    assert MPSSharing(EventLoop(), ONE_GPU, {}, model=None, contention=0.3).decode_contention == 0.3  # type: ignore[arg-type]


def test_the_per_row_charge_slows_a_capped_runs_decode_in_the_twin(llava_spec, toy_model) -> None:
    """The same capped run on one GPU: a per-row charge lengthens every request's decode (TPOT),
    and more at a higher rate, where more rows share each step."""
    import copy

    caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
    out = {}
    for rate in (0.5, 2.0):
        reqs = generate(llava_spec, rate, 80, seed=5)
        for row in (0.0, 2.0):
            model = copy.copy(toy_model)
            model.mps_constants = {**(toy_model.mps_constants or {}), "decode_row_ms": row}
            out[rate, row] = simulate_system(llava_spec, reqs, "easerve", model, host_gpus=1,
                                             mps_caps=caps).summary["tpot"]["mean"]
    assert out[0.5, 2.0] > out[0.5, 0.0] and out[2.0, 2.0] > out[2.0, 0.0]
    assert out[2.0, 2.0] - out[2.0, 0.0] > out[0.5, 2.0] - out[0.5, 0.0]


def test_a_kv_handoff_on_one_gpu_takes_the_ipc_path_unless_the_runtime_turns_it_off(llava_spec, toy_model) -> None:
    """The runtime hands a cache to a decode process on the same GPU by CUDA IPC (``engines.kv_ipc``,
    on by default): the twin charges those handoffs the profile's ``kv_ipc`` path, and the KV path
    where the pods have GPUs of their own or the runtime's IPC is off (``EASERVE_KV_IPC=0``)."""
    import copy

    caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
    reqs = generate(llava_spec, 1.0, 40, seed=3)

    def paths(host_gpus: int, **kw: object) -> tuple[list[str], float]:
        model = copy.copy(toy_model)
        model._transfer = {}
        seen: list[str] = []
        inner = model.transfer_s

        def recording(nbytes: int, *, path: str = "embedding") -> float:
            seen.append(path)
            return inner(nbytes, path=path) + (0.0 if path == "kv_ipc" else 0.5 if path == "kv" else 0.0)

        model.transfer_s = recording  # type: ignore[method-assign]
        res = simulate_system(llava_spec, reqs, "easerve", model, host_gpus=host_gpus, mps_caps=caps, **kw)
        assert len(res.records) == len(reqs)
        return [p for p in seen if p != "embedding"], res.summary["tpot"]["mean"]

    one, tpot_ipc = paths(1)
    off, tpot_host = paths(1, kv_ipc=False)
    own, _ = paths(8)
    assert one and set(one) == {"kv_ipc"}
    assert off and set(off) == {"kv"} and len(off) == len(one)
    assert own and set(own) == {"kv"}
    assert tpot_host > tpot_ipc  # the host path's half second a handoff lengthens every decode


def test_each_further_prefilling_pod_adds_its_own_per_row_charge_to_decode(llava_spec) -> None:
    """Runs 18-28 on the H100: the decode step's excess read 0.37 ms a row where one capped pod
    prefills and 0.40 where two do (a local prefill in the encode pod beside a remote prefill pod,
    or two encode pods). ``prefill_pods`` names the pods that prefill from the spec, and
    ``decode_row_extra_ms`` charges each one beyond the first."""
    from easerve_runtime.sim.mpsshare import prefill_pods

    def at(s: float, encode: int = 1, prefill: int = 1):
        return llava_spec.model_copy(update={
            "offload": llava_spec.offload.model_copy(update={"ratio": s}),
            "allocation": llava_spec.allocation.model_copy(update={
                "encode": llava_spec.allocation.encode.model_copy(update={"replicas": encode}),
                "prefill": llava_spec.allocation.prefill.model_copy(update={"replicas": prefill})})})

    assert prefill_pods(at(0.5)) == {"encode/0", "prefill/0"}
    assert prefill_pods(at(1.0)) == {"prefill/0"}  # Dynamo-style: the encode pod only encodes
    assert prefill_pods(at(0.0, encode=2, prefill=0)) == {"encode/0", "encode/1"}
    caps = {"encode": 0.85, "prefill": 0.85}
    kw = {"decode_row_ms": 0.36, "decode_row_extra_ms": 0.04}
    two = MPSSharing(EventLoop(), ONE_GPU, caps, model=None, prefill_pods=prefill_pods(at(0.5)), **kw)  # type: ignore[arg-type]
    one = MPSSharing(EventLoop(), ONE_GPU, caps, model=None, prefill_pods=prefill_pods(at(1.0)), **kw)  # type: ignore[arg-type]
    assert two.decode_rows_s("decode/0", 20) == pytest.approx(20 * 0.40 / 1e3)
    assert one.decode_rows_s("decode/0", 20) == pytest.approx(20 * 0.36 / 1e3)
    assert two.decode_rows_s("prefill/0", 20) == 0.0  # capped pods pay their caps, not rows


def test_an_encoders_host_part_holds_no_gpu_and_is_not_slowed(toy_model) -> None:
    """A CPU-preprocessing encoder batch (``StageModel.encode_host_s``) dispatched now runs its host
    part first: until that ends it is not work in flight on the GPU (a prefill dispatched then pays
    no contention), after it it is; the host part pays no sharing factor, the GPU part does."""
    from easerve_runtime.sim.stages import Busy

    class Encoder(Busy):
        work = "encode"

    loop = EventLoop()
    caps = {"encode": 0.85, "prefill": 0.85}
    m = MPSSharing(loop, ONE_GPU, caps, toy_model, contention=0.1, decode_saturation=mpsshare.MIN_FREE,
                   decode_corun=0.0, encode_corun=0.0)
    enc = Encoder()
    enc.ts, enc.proc = m, "encode/0"
    alone = m.share_factor("prefill", 0.85)
    dt = enc.timesliced(0.010, host_s=0.005)
    assert dt == pytest.approx(0.005 + 0.010 * m.share_factor("encode", 0.85))
    seen: dict[str, float] = {}
    loop.at(0.004, lambda: seen.update(host=m.dilation("prefill/0", "prefill")))
    loop.at(0.006, lambda: seen.update(gpu=m.dilation("prefill/0", "prefill")))
    loop.at(dt + 1e-6, lambda: seen.update(after=m.dilation("prefill/0", "prefill")))
    loop.run()
    beside = m.share_factor("prefill", 0.5) * 1.1  # two 85 % caps in flight split the SMs, and contend
    assert seen == pytest.approx({"host": alone, "gpu": beside, "after": alone})
    loop2 = EventLoop()  # without a host part the batch is in flight from its dispatch
    m2 = MPSSharing(loop2, ONE_GPU, caps, toy_model, contention=0.1, decode_saturation=mpsshare.MIN_FREE,
                    decode_corun=0.0, encode_corun=0.0)
    enc.ts = m2
    enc.timesliced(0.010)
    assert m2.dilation("prefill/0", "prefill") == pytest.approx(beside)
