"""GPU checks (run on the device machine): green partitions are disjoint, graphs on a partition
compute the same function, the engine honours the protocol. Skipped without a CUDA GPU."""

from __future__ import annotations

import asyncio

import pytest
from easerve_runtime.engines.base import EncodeInput, MediaPart

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_detect_and_pool_levels_are_disjoint_splits() -> None:
    from easerve_runtime.partition.backends import GreenContextPool, detect_backend

    info = detect_backend("green-context")
    assert info.total_sms > 0
    if info.name != "green-context":
        pytest.skip(f"no green contexts here: {info.reason}")
    pool = GreenContextPool([16, 64])
    assert pool.total_sms == info.total_sms
    for sms, lv in pool.levels.items():
        assert lv.sms >= sms and lv.sms % 8 == 0
        assert lv.sms + lv.partner_sms == pool.total_sms
    assert pool.primary(pool.total_sms) is pool.full_primary


def test_graph_on_partition_matches_eager() -> None:
    import torch
    from easerve_runtime.engines.torch_encode import GraphedEncoder, build_encoder
    from easerve_runtime.partition.backends import GreenContextPool

    pool = GreenContextPool([32])
    enc = build_encoder("clip-vit-l-336")
    g = GraphedEncoder(enc, buckets=(2,))
    s = pool.primary(32)
    g.capture(2, s)
    _, x, _ = g._graphs[(2, id(s))]
    x.copy_(torch.randn_like(x))
    y = g.run(2, s)
    s.synchronize()
    with torch.inference_mode():
        ref = enc.forward(x.float().to(torch.bfloat16))
    torch.cuda.synchronize()
    rel = (y.float() - ref.float()).norm() / ref.float().norm()
    assert torch.isfinite(y).all() and rel < 2e-2


def test_engine_protocol_shapes() -> None:
    from easerve_runtime.engines.base import EncodeEngine
    from easerve_runtime.engines.torch_encode import TorchEncodeEngine
    from easerve_runtime.partition.backends import GreenContextPool

    eng = TorchEncodeEngine("clip-vit-l-336", pool=GreenContextPool([64]), buckets=(1, 2, 4))
    assert isinstance(eng, EncodeEngine)
    batch = [
        EncodeInput("a", (MediaPart("image", b"x"),)),
        EncodeInput("b", (MediaPart("image", b"y"), MediaPart("image", b"z"))),
    ]
    out = asyncio.run(eng.encode(batch, sm_share=0.5))
    assert [e.request_id for e in out] == ["a", "b"]
    assert out[0].shape == (577, 1024) and out[1].shape == (2 * 577, 1024)
    assert len(out[1].data) == 2 * 577 * 1024 * 2 and out[0].dtype == "bfloat16"
