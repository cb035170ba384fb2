"""``gpu_serve.py``'s system names (``gpu_systems.py``): any point of HAS's space deployed by name,
round trips, refusals that name the wrong part, and the specs the names render, checked by the real
spec model against what ``space.apply_candidate`` makes of the same candidate. No GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from easerve_operator.tuning.space import Alloc, Candidate, apply_candidate, enumerate_allocations
from easerve_runtime.api import parse_spec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_serve  # noqa: E402
import gpu_systems  # noqa: E402
from gpu_systems import parse, point, token  # noqa: E402


def spec_of(system: str) -> dict:
    return gpu_serve.spec_doc(system, Path("/models/llava"), 4.0, 0.45)["spec"]


# ------------------------------------------------------------------ the grammar
@pytest.mark.parametrize("name", [
    "easerve", "easerve-own-process", "dynamo-style", "aggregated", "aggregated@4096",
    "easerve:e1p1d1:b4:s0.5", "easerve:e2p0d1:b16:s0", "easerve:e1p1d1:b1:s1", "easerve:e2p1tp2d1tp4:b8:s0.3",
    "dynamo-style:e1p2d1", "dynamo-style:e1p1d2tp2",
    "easerve:e1p0d1:b6:s0+mps70", "easerve:e1p0d1:b6:s0:cpu+mps50", "dynamo-style:e1p1d1+mps100", "easerve+mps60",
    "easerve:e1p0d1:b1:s0+mps85+kvipc", "dynamo-style:e1p1d1+kvipc", "easerve:e1p0d1:b1:s0+mps85+hostkv",
    "dynamo-style:e1p1d1+hostkv", "easerve:e1p1d1:b1:s1+mps85+q18", "dynamo-style:e1p1d1+mps85+kvipc+q20",
])
def test_a_name_parses_to_the_system_whose_name_it_is(name: str) -> None:
    assert parse(name).name == name


def test_a_point_of_has_space_round_trips_through_its_name() -> None:
    for a in enumerate_allocations(8, 1, local_prefill=True):
        s = 0.0 if a.prefill == 0 else 0.7
        sys_ = point("easerve", a, 5, s)
        assert parse(sys_.name) == sys_
        assert (sys_.layout, sys_.batch_bound, sys_.offload) == (a, 5, s)
        if a.prefill:
            assert parse(point("dynamo-style", a).name).layout == a


@pytest.mark.parametrize(("name", "part", "why"), [
    ("easy", "'easy'", "is not one of"),
    ("easerve:e1p1d1:b4", "3 part(s)", "easerve:ALLOC:bB:sS"),
    ("dynamo-style:e1p1d1:b4:s1", "got 3", "dynamo-style:ALLOC"),
    ("easerve:x1p1d1:b4:s0.5", "'x1p1d1'", "e<N>p<N>d<N>"),
    ("easerve:e0p1d1:b4:s0.5", "'e0p1d1'", "at least one encode worker"),
    ("easerve:e1p1d0:b4:s0.5", "'e1p1d0'", "at least one decode worker"),
    ("easerve:e1p1tp1d1:b4:s0.5", "'e1p1tp1d1'", "write 'e1p1d1'"),
    ("easerve:e1p1d1:b0:s0.5", "'b0'", "batch bound"),
    ("easerve:e1p1d1:4:s0.5", "'4'", "batch bound"),
    ("easerve:e1p1d1:b4:s1.5", "'s1.5'", "offload ratio"),
    ("easerve:e1p1d1:b4:0.5", "'0.5'", "offload ratio"),
    ("easerve:e1p1d1:b4:s0.50", "'s0.50'", "write 's0.5'"),
    ("easerve:e1p0d1:b4:s0.5", "'s0.5'", "s must be 0"),
    ("dynamo-style:e1p0d1", "'e1p0d1'", "needs a prefill worker"),
    ("aggregated@x", "'x'", "positive integer"),
    ("easerve@2048", "'easerve@2048'", "only aggregated takes @TOKENS"),
    ("aggregated:e1p1d1", "'aggregated:e1p1d1'", "only easerve and dynamo-style"),
    ("easerve:e1p0d1:b6:s0+mps0", "'mps0'", "mpsNN"),
    ("easerve:e1p0d1:b6:s0+mps070", "'mps070'", "mpsNN"),
    ("easerve:e1p0d1:b6:s0+mps", "'mps'", "mpsNN"),
    ("aggregated@4096+mps50", "aggregated", "+mps50 has nothing to change"),
    ("aggregated@4096+kvipc", "aggregated", "+kvipc has nothing to change"),
    ("aggregated@4096+hostkv", "aggregated", "+hostkv has nothing to change"),
    ("dynamo-style:e1p1d1+kvipc+mps50", "+mpsNN comes once, before +kvipc or +hostkv", "before +kvipc"),
    ("dynamo-style:e1p1d1+hostkv+mps50", "+mpsNN comes once, before +kvipc or +hostkv", "before +kvipc"),
    ("dynamo-style:e1p1d1+mps50+mps70", "+mpsNN comes once", "before +kvipc"),
    ("dynamo-style:e1p1d1+kvipc+kvipc", "the KV path (+kvipc or +hostkv) is named twice", "twice"),
    ("dynamo-style:e1p1d1+kvipc+hostkv", "the KV path (+kvipc or +hostkv) is named twice", "twice"),
    ("dynamo-style:e1p1d1+ipc", "'ipc'", "kvipc, hostkv or qNN"),
    ("easerve:e1p1d1:b1:s1+q18+mps85", "+qNN comes last", "last"),
    ("easerve:e1p1d1:b1:s1+mps85+q0", "+qNN (the admission bound, NN >= 1)", "once, last"),
    ("easerve:e1p1d1:b1:s1+mps85+q18+q20", "+qNN (the admission bound, NN >= 1)", "once, last"),
])
def test_a_bad_name_is_refused_naming_the_part_that_is_wrong(name: str, part: str, why: str) -> None:
    with pytest.raises(ValueError) as err:
        parse(name)
    assert part in str(err.value) and why in str(err.value)


def test_gpu_serve_refuses_a_bad_name_before_anything_starts(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_serve.py"), "--out", str(tmp_path),
                        "--systems", "easerve,easerve:e1p1d1:b4:s0.50"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "write 's0.5'" in r.stderr
    assert not (tmp_path / "gpu_serve.json").exists()


def test_gpu_serve_refuses_a_name_the_spec_model_refuses_in_its_words() -> None:
    """The grammar takes TP (HAS's space has it); the torch engine does not: the spec model says so."""
    with pytest.raises(ValueError, match=r"spec.allocation.prefill.tensorParallel.*torch engine runs TP 1"):
        gpu_serve.refuse_unservable(gpu_serve.spec_doc("easerve:e1p1tp2d1:b4:s0.5", Path("/m"), 4.0, 0.45))


# ------------------------------------------------------------------ the specs
def test_the_fixed_systems_render_the_specs_they_always_did() -> None:
    e, d = spec_of("easerve"), spec_of("dynamo-style")
    assert e["allocation"] == gpu_systems.SYSTEMS["easerve"]["allocation"] and e["gpuBudget"] == 2
    assert e["encode"] == {"batchBound": 8, "dispatch": "poisson-gap", "maxAgeMs": 50, "preprocessing": "gpu"}
    assert d["encode"] == {"batchBound": 1, "dispatch": "eager", "preprocessing": "cpu"}
    assert d["offload"] == {"ratio": 1.0} and d["smPartition"] == {"mode": "none"} and d["gpuBudget"] == 3
    agg = spec_of("aggregated@4096")
    assert agg["aggregated"] == {"tokenBudget": 4096} and agg["mode"] == "aggregated"
    assert gpu_serve.spec_doc("aggregated@4096", Path("/m"), 4.0, 0.45)["metadata"]["name"] == "gpu-aggregated-tb4096"


def test_a_fixed_admission_bound_reaches_the_spec_and_the_frontend() -> None:
    """``+qNN`` fixes the frontend's admission bound (``spec.limits.maxQueuedRequests``); without it
    the spec leaves the bound to the profile's capacity."""
    from easerve_runtime.policies.admission import admission_queue

    fixed = parse_spec(spec_of("easerve:e1p1d1:b1:s1+mps85+q18"))
    assert fixed.limits.max_queued_requests == 18
    assert admission_queue(fixed.limits, 7.1).bound == 18 and not admission_queue(fixed.limits, 7.1).adaptive
    assert "limits" not in spec_of("easerve:e1p1d1:b1:s1+mps85")
    assert parse("dynamo-style:e1p1d1+mps85+q18").env == parse("dynamo-style:e1p1d1+mps85").env


@pytest.mark.parametrize("budget", [2, 3, 4, 5])
def test_every_point_of_has_space_renders_the_spec_has_would_deploy(budget: int) -> None:
    """Through the real spec model (torch engine): the allocation, B, s and SM split of the spec a
    name renders are those ``space.apply_candidate`` gives the same candidate."""
    base = parse_spec({**spec_of("easerve"), "gpuBudget": budget})
    for a in enumerate_allocations(budget, 1, local_prefill=True, tp_options=(1,)):
        for s in ((0.0,) if a.prefill == 0 else (0.0, 0.4, 1.0)):
            c = Candidate(a, 3, s)
            name = point("easerve", a, 3, s).name
            spec = parse_spec(spec_of(name))
            want = apply_candidate(base, c)
            assert spec.allocation == want.allocation and spec.gpu_budget == a.gpus
            assert spec.encode == want.encode and spec.offload == want.offload
            assert spec.sm_partition.mode == want.sm_partition.mode
        if a.prefill:
            spec = parse_spec(spec_of(f"dynamo-style:{token(a)}"))
            assert Alloc.from_allocation(spec.allocation) == a and spec.offload.ratio == 1.0
            assert spec.encode.batch_bound == 1 and str(spec.encode.dispatch) == "eager"


def test_a_dynamo_style_point_preprocesses_on_the_cpu_and_its_twin_knows() -> None:
    assert str(parse_spec(spec_of("dynamo-style:e1p2d1")).encode.preprocessing) == "cpu"
    assert str(parse_spec(spec_of("easerve:e1p1d1:b4:s0.5")).encode.preprocessing) == "gpu"
    assert parse("dynamo-style:e1p2d1").cpu_preprocessing and not parse("easerve:e1p1d1:b4:s0.5").cpu_preprocessing


def test_an_easerve_point_may_preprocess_on_the_cpu_and_says_so_in_its_one_name() -> None:
    sys_ = parse("easerve:e1p0d1:b6:s0:cpu")
    assert sys_.cpu_preprocessing and sys_.name == "easerve:e1p0d1:b6:s0:cpu"
    spec = parse_spec(spec_of(sys_.name))
    assert str(spec.encode.preprocessing) == "cpu" and spec.encode.batch_bound == 6
    # the base's own preprocessing is not spelled: one name per configuration
    assert point("easerve", Alloc(1, 0, 1, 1, 1), 6, 0.0, "gpu").name == "easerve:e1p0d1:b6:s0"
    assert point("easerve", Alloc(1, 0, 1, 1, 1), 6, 0.0, "cpu").name == "easerve:e1p0d1:b6:s0:cpu"
    with pytest.raises(ValueError, match="':cpu'"):
        parse("easerve:e1p0d1:b6:s0:gpu")


def test_an_mps_system_caps_encode_and_prefill_and_leaves_decode_free() -> None:
    """``+mpsNN``: the same spec, the encode and prefill processes capped under MPS, decode not."""
    from easerve_runtime.workers.launcher import MPS_SHARES_ENV, mps_shares

    sys_ = parse("dynamo-style:e1p1d1+mps50")
    assert sys_.mps == 50 and sys_.layout == parse("dynamo-style:e1p1d1").layout
    assert spec_of(sys_.name) == spec_of("dynamo-style:e1p1d1")
    assert mps_shares(sys_.env[MPS_SHARES_ENV]) == {"encode": 50, "local-prefill": 50, "prefill": 50}
    assert MPS_SHARES_ENV not in parse("dynamo-style:e1p1d1").env
    assert sys_.slug == "dynamo-style-e1p1d1-mps50"


def test_the_kv_path_suffixes_set_the_same_gpu_kv_share_and_change_nothing_else() -> None:
    """The A/B of ``engines.kv_ipc``: ``+hostkv`` turns the default CUDA IPC handoff off, ``+kvipc``
    names it on (run 28's names); the same spec and caps either way."""
    from easerve_runtime.engines.kv_ipc import DEFAULT, ENV

    on, off = parse("easerve:e1p0d1:b1:s0+mps85+kvipc"), parse("easerve:e1p0d1:b1:s0+mps85+hostkv")
    plain = parse("easerve:e1p0d1:b1:s0+mps85")
    assert (on.kv_ipc, off.kv_ipc, plain.kv_ipc) == (True, False, None) and on.mps == off.mps == 85
    assert spec_of(on.name) == spec_of(off.name) == spec_of(plain.name)
    assert on.env == {**plain.env, ENV: "1"} and off.env == {**plain.env, ENV: "0"} and ENV not in plain.env
    assert DEFAULT == "1"  # the plain name serves the IPC path
    assert (on.slug, off.slug) == ("easerve-e1p0d1-b1-s0-mps85-kvipc", "easerve-e1p0d1-b1-s0-mps85-hostkv")
