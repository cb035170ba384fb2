"""``benchmarks/decode_kernels.py``: its kernel categories, and its ``--smoke`` run (tiny model, CPU)
end to end: both sides measured per batch, ratios and diffs written. Nothing here asserts a timing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("decode_kernels", BENCH / "decode_kernels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_names_fall_in_their_categories() -> None:
    cat = _bench().category
    names = {  # kernel names as torch.profiler shows them on an H200 (abridged)
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<>::Params)": "attention",
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>": "attention",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNN": "gemm/matmul",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>": "gemm/matmul",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16>": "gemm/matmul",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)>": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::cos_kernel_cuda(at::TensorIteratorBase&)>": "rotary",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2>>": "rotary",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>": "softmax/sampling",
        "_decode_attn_split_kernel": "attention",  # ours (engines/decode_attention.py)
        "_decode_attn_merge_kernel": "attention",
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<index_put_kernel_impl>>": "elementwise/copy/index",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise/copy/index",
        "Memcpy DtoD (Device -> Device)": "elementwise/copy/index",
        "aten::mm": "gemm/matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    }
    assert {n: cat(n) for n in names} == names


def test_device_events_sum_per_kernel_and_step() -> None:
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name: str, us: float, dev: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("gemm_a", 10.0), ev("gemm_a", 30.0), ev("fmha", 5.0), ev("aten::mm", 99.0, DeviceType.CPU)]
    table = _bench().device_table(events, steps=2)
    assert table == {"gemm_a": (0.02, 1.0), "fmha": (0.0025, 0.5)}


@pytest.mark.slow
def test_smoke_run_writes_both_sides(model_dirs: dict[str, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _bench()
    monkeypatch.setattr(mod.ge, "DEVICE", mod.ge.DEVICE)  # --smoke sets it to cpu; put it back after
    out = tmp_path / "out"
    assert mod.main(["--smoke", "--batches", "1", "2", "--model", str(model_dirs["llava-next"]),
                     "--out", str(out)]) == 0
    doc = json.loads((out / "decode_kernels.json").read_text())
    assert (out / "decode_kernels.png").stat().st_size > 0
    assert set(doc["batches"]) == {"b1", "b2"}
    for row in doc["batches"].values():
        for side in ("ours", "ref", "ref_gqa"):
            assert row[side]["step_ms"] > 0 and row[side]["top"] and row[side]["kernel_calls_per_step"] > 0
            assert set(row[side]["categories"]) == set(mod.CATEGORIES)
        step = row["step_ms"]
        assert step["ratio"] == pytest.approx(step["ours"] / step["ref"], rel=1e-2)
        assert step["ratio_vs_ref_gqa"] > 0
        assert {"categories", "kernels", "total_extra_ms"} <= set(row["diff"]) and "diff_vs_ref_gqa" in row
        assert set(row["ours_variants"]) >= {"stock_sdpa", "gqa_nomask"}
        # the stock attention under the static cache's mask repeats K/V: more copies than without a mask
        assert row["ref"]["kernel_calls_per_step"] > row["ref_gqa"]["kernel_calls_per_step"]
