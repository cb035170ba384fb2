"""Small pieces of the torch engine: sampling, the KV codec, remote-code refusal, detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest


def test_sampling_greedy_top_p_and_seed() -> None:
    import torch
    from easerve_runtime.engines.base import Sampling
    from easerve_runtime.engines.hf import sample

    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    assert sample(logits, Sampling(temperature=0.0), 0) == 1
    assert sample(logits, None, 5) == 1  # no sampling given: greedy
    # a nucleus smaller than the top token's mass keeps only the top token
    assert {sample(logits, Sampling(1.0, 0.01, s), 0) for s in range(20)} == {1}
    draws = [sample(logits, Sampling(2.0, 1.0, 7), p) for p in range(50)]
    assert draws == [sample(logits, Sampling(2.0, 1.0, 7), p) for p in range(50)]  # seeded
    assert len(set(draws)) > 1  # and really sampled
    assert 3 in {sample(logits, Sampling(50.0, 1.0, s), 0) for s in range(200)}  # hot: the tail appears


def test_batched_sampling_is_the_distribution_and_ignores_the_batch() -> None:
    """``sample_rows``: each row's draw is a function of (seed, position) only, whoever shares the
    batch; over many positions the draws follow softmax(logits / T) on the top-p set. The noise is
    a hash, so these counts are the same on every run (no flaky tolerance)."""
    import torch
    from easerve_runtime.engines.base import Sampling
    from easerve_runtime.engines.hf import sample, sample_rows

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 20_000
    counts = torch.zeros(4)
    for pos in range(n):
        counts[sample(logits, Sampling(1.0, 1.0, 3), pos)] += 1
    assert torch.allclose(counts / n, torch.softmax(logits, 0), atol=0.01)
    counts = torch.zeros(4)
    for pos in range(5_000):  # top-p 0.7: the two likeliest (0.64 then 0.24) stay, renormalised
        counts[sample(logits, Sampling(1.0, 0.7, 3), pos)] += 1
    assert counts[0] == counts[3] == 0 and abs(float(counts[2] / counts.sum()) - 0.731) < 0.02
    rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    mixed = [Sampling(0.0), Sampling(0.8, 0.9, 11), Sampling(1.3, 1.0, 12), None, Sampling(1.0, 0.5, 13),
             Sampling(2.0, 1.0, 14)]
    together = sample_rows(rows, mixed, [4, 5, 6, 7, 8, 9])
    alone = [sample(rows[i], mixed[i], 4 + i) for i in range(6)]
    assert together == alone
    assert together[0] == int(rows[0].argmax()) and together[3] == int(rows[3].argmax())  # greedy rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_pack_unpack_round_trip(dtype: str) -> None:
    import torch
    from easerve_runtime.engines.hf import pack_kv, unpack_kv

    class Layer:
        def __init__(self) -> None:
            self.keys = torch.randn(1, 2, 5, 4).to(getattr(torch, dtype))
            self.values = torch.randn(1, 2, 5, 4).to(getattr(torch, dtype))

    class Cache:
        layers = [Layer(), Layer(), Layer()]

    data, meta = pack_kv(Cache())
    assert meta == {"shape": [3, 2, 2, 5, 4], "dtype": dtype}
    kv = unpack_kv(data, meta)
    for i, layer in enumerate(Cache.layers):
        assert torch.equal(kv[i, 0], layer.keys[0]) and torch.equal(kv[i, 1], layer.values[0])
    with pytest.raises(ValueError, match="bytes received"):
        unpack_kv(data[:-2], meta)


def test_remote_code_is_refused_unless_the_spec_opts_in(tmp_path: Path) -> None:
    from easerve_runtime.models.loading import ModelDirError, check_remote_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "ultravox", "auto_map": {"AutoConfig": "x.Y"}}))
    with pytest.raises(ModelDirError, match=r"spec.model.trustRemoteCode"):
        check_remote_code(tmp_path, trust_remote_code=False)
    check_remote_code(tmp_path, trust_remote_code=True)


def test_incremental_detokenization_matches_a_full_decode(model_dirs: dict[str, Path]) -> None:
    from easerve_runtime.models.loading import Detokenizer, load_tokenizer

    tok = load_tokenizer(model_dirs["llava-next"])
    ids = tok("The quick brown fox, naïve café — 1 2 3.")["input_ids"]
    d = Detokenizer(tok)
    assert "".join(d.push(i) for i in ids) == tok.decode(ids, skip_special_tokens=True)


def test_stage_loading_reads_only_its_weights(model_dirs: dict[str, Path]) -> None:
    from easerve_runtime.models.loading import load_stage

    d = model_dirs["llava-next"]
    enc = load_stage(d, "encode").model
    lm = load_stage(d, "lm").model

    def n_params(module: object) -> int:
        return sum(p.numel() for p in module.parameters())  # type: ignore[attr-defined]

    assert len(enc.model.language_model.layers) == 0 and len(lm.model.language_model.layers) == 2
    assert len(lm.model.vision_tower.encoder.layers) == 0  # lm: the tower at depth 0
    assert n_params(enc.model.vision_tower) > 2 * n_params(lm.model.vision_tower)
    assert n_params(lm.model.language_model) > 100 * n_params(enc.model.language_model)


def test_encode_stage_stops_at_the_feature_layer_with_the_same_features(model_dirs: dict[str, Path]) -> None:
    """The encode stage's tower ends at ``vision_feature_layer`` (the tiny model's -2 of 2 layers:
    one layer), and its image features equal the whole model's ``get_image_features`` bit for bit."""
    import torch
    import transformers
    from easerve_runtime.models.loading import load_processor, load_stage
    from PIL import Image

    d = model_dirs["llava-next"]
    enc = load_stage(d, "encode")
    full = transformers.LlavaNextForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    depth = full.config.vision_config.num_hidden_layers
    assert full.config.vision_feature_layer == -2
    assert len(enc.model.model.vision_tower.encoder.layers) == depth - 1
    assert enc.config.vision_feature_layer == depth - 1  # the same hidden state, counted from the input
    proc = load_processor(d)
    img = Image.fromarray((np.random.default_rng(3).random((90, 130, 3)) * 255).astype("uint8"))
    px = proc.image_processor([img], return_tensors="pt")
    with torch.inference_mode():
        want = full.model.get_image_features(px["pixel_values"], px["image_sizes"]).pooler_output
        got = enc.model.model.get_image_features(
            px["pixel_values"], px["image_sizes"], vision_feature_layer=enc.config.vision_feature_layer
        ).pooler_output
    assert len(got) == len(want) == 1
    assert torch.equal(got[0], want[0])


def test_feature_layer_outside_the_tower_is_refused() -> None:
    from types import SimpleNamespace

    from easerve_runtime.models.loading import ModelDirError, truncate_to_feature_layer

    cfg = SimpleNamespace(vision_feature_layer=[-2, 3], vision_config=SimpleNamespace(num_hidden_layers=24))
    assert truncate_to_feature_layer(cfg) == 23 and cfg.vision_feature_layer == [23, 3]
    bad = SimpleNamespace(vision_feature_layer=-30, vision_config=SimpleNamespace(num_hidden_layers=24))
    with pytest.raises(ModelDirError, match="vision_feature_layer"):
        truncate_to_feature_layer(bad)
    assert truncate_to_feature_layer(SimpleNamespace(vision_config=SimpleNamespace(depth=4))) is None


def test_slot_decode_attention_equals_transformers_sdpa_with_repeated_kv() -> None:
    """The grouped-query fold reads each KV head once and computes what repeat_kv + SDPA computes."""
    import types

    import torch
    from easerve_runtime.engines.hf import slot_decode_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=4, is_causal=True)
    n, kv_heads, length, d = 3, 2, 40, 16
    q = torch.randn(n, kv_heads * 4, 1, d)
    k, v = torch.randn(n, kv_heads, length, d), torch.randn(n, kv_heads, length, d)
    pos = torch.tensor([5, 20, 39])
    mask = (torch.arange(length)[None] <= pos[:, None])[:, None, None, :]
    ours, _ = slot_decode_attention(module, q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == ref.shape == (n, 1, kv_heads * 4, d)
    torch.testing.assert_close(ours, ref)


def test_kv_bucket_covers_the_longest_row_and_caps_at_the_slot() -> None:
    from easerve_runtime.engines.hf import kv_bucket

    assert kv_bucket(1, 4096) == 256
    assert kv_bucket(257, 4096) == 512
    assert kv_bucket(1024, 4096) == 1024
    assert kv_bucket(1025, 4096) == 1536  # past 1024: the next multiple of 512, not the next power of two
    assert kv_bucket(2049, 4096) == 2560
    assert kv_bucket(2901, 4096) == 3072  # a 1080p LLaVA-NeXT prompt reads 3072 positions, not 4096
    assert kv_bucket(4000, 4096) == 4096
    assert kv_bucket(2049, 2304) == 2304
    for need in range(1, 4097, 7):
        assert need <= kv_bucket(need, 4096) <= 4096


def test_start_up_capture_covers_every_bucket_a_step_can_use(model_dirs: dict[str, Path]) -> None:
    """``graph_buckets`` lists every (batch bucket, K/V bucket) pair a step can hit, small first,
    so a start-up capture within its budget leaves nothing for the serving path; on a CPU nothing
    is captured."""
    from easerve_runtime.engines.hf import HFDecodeEngine, kv_bucket

    eng = HFDecodeEngine(model_dirs["llava-next"], max_len=2048, max_slots=5)
    got = eng.graph_buckets()
    want = {(eng._bucket(n), kv_bucket(need, eng.max_len)) for n in range(1, eng.slots + 1)
            for need in range(1, eng.max_len + 1)}
    assert set(got) == want and len(got) == len(want)
    assert got == sorted(got)
    assert "precaptured" not in eng.stats  # cuda_graphs is off on a CPU


def test_decode_engine_uses_the_slot_attention(model_dirs: dict[str, Path]) -> None:
    from easerve_runtime.engines.hf import SLOT_ATTENTION, HFDecodeEngine

    eng = HFDecodeEngine(model_dirs["llava-next"], max_len=64, max_slots=2)
    layer = eng.model.model.language_model.layers[0].self_attn
    assert layer.config._attn_implementation == SLOT_ATTENTION


def test_batched_anyres_preprocessing_equals_the_library_per_image(tmp_path: Path) -> None:
    """Same-size images through the processor's own steps at once give the library's exact tensors."""
    pytest.importorskip("torchvision")
    import torch
    from easerve_runtime.engines.hf import batch_image_processor
    from easerve_runtime.models.init import init_model
    from easerve_runtime.models.loading import load_processor

    d = init_model("llava-next", tmp_path / "m", size="7b", weights=False)
    lib, ours = load_processor(d, False), load_processor(d, False)
    if not batch_image_processor(ours):
        pytest.skip("not the torchvision LLaVA-NeXT processor")
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 200, 360), (3, 120, 200), (3, 200, 360), (3, 90, 60), (3, 200, 360)]
    imgs = [torch.randint(0, 256, s, dtype=torch.uint8, generator=g) for s in shapes]
    texts = ["<image> hi"] * len(imgs)
    a = lib(text=texts, images=imgs, return_tensors="pt", padding=True, device="cpu")
    b = ours(text=texts, images=imgs, return_tensors="pt", padding=True, device="cpu")
    for key in ("input_ids", "pixel_values", "image_sizes"):
        assert torch.equal(a[key], b[key]), key


def test_a_mapped_blob_take_is_the_kv_cache_without_a_copy(tmp_path: Path) -> None:
    """decode takes a same-host KV blob as a private mapping of its file: the same bytes, writable
    (the tensor wraps them), the file gone at once, and writing never reaches the sender's file."""
    import torch
    from easerve_runtime.engines.hf import _to_bytes, kv_meta, unpack_kv
    from easerve_runtime.workers.blobs import HostBlobs

    kv = torch.randn(2, 2, 3, 7, 4).to(torch.bfloat16)
    blobs = HostBlobs(tmp_path)
    name = blobs.put_sync(_to_bytes(kv))
    data = blobs.take_sync(name, mapped=True)
    assert not list(tmp_path.iterdir())  # taken: the name is free, the mapping keeps the pages
    back = unpack_kv(data, kv_meta(kv))
    assert torch.equal(back, kv)
    back.view(torch.int16)[0, 0, 0, 0, 0] += 1  # writable, copy-on-write: nothing else sees it
    assert not torch.equal(back, kv)
    with pytest.raises(ValueError, match="is gone"):
        blobs.take_sync(name, mapped=True)
    empty = blobs.put_sync(b"")
    assert len(blobs.take_sync(empty, mapped=True)) == 0


def test_encode_and_local_prefill_take_one_green_level_from_one_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, one ``GreenContextPool``: for the split a partition record grants (encode's
    share, local prefill's complement) the encoder takes the level's primary stream and the
    prefill the SAME level's partner stream, so the two never share SMs. At the whole GPU, on the
    CPU or without a pool, neither switches streams. (The pool is a stand-in: no CUDA here.)"""
    import contextlib
    from types import SimpleNamespace

    import torch
    from easerve_runtime.engines.hf import HFEncodeEngine, HFPrefillEngine

    total = 132
    pool = SimpleNamespace(
        total_sms=total,
        levels={s: SimpleNamespace(sms=s, partner_sms=total - s) for s in range(16, total, 8)},
        primary=lambda s: ("primary", s),
        partner=lambda s: ("partner", s),
    )
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(s))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=total))
    enc, pre = object.__new__(HFEncodeEngine), object.__new__(HFPrefillEngine)
    for e in (enc, pre):
        e.pool, e.device = pool, "cuda"
    for primary in (16, 64, 96, 104, 128):
        with enc._stream_ctx(primary / total) as a, pre._stream_ctx((total - primary) / total) as b:
            assert (a, b) == (("primary", primary), ("partner", primary))
    with enc._stream_ctx(1.0) as a:
        assert a is None
    enc.device = "cpu"
    with enc._stream_ctx(0.5) as a:
        assert a is None


def test_prefill_on_a_gpu_keeps_sdpa_off_cudnn_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN attention builds a graph per new sequence length (43 ms a first call on the H200,
    benchmarks/prefill_shapes.py), and served prompts seldom repeat one: a prefill engine on a GPU
    turns that backend off for its process; on the CPU, or with EASERVE_CUDNN_SDPA=1, it is left."""
    import torch
    from easerve_runtime.engines.hf import CUDNN_SDPA_ENV, prefer_flash_prefill

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert prefer_flash_prefill("cpu") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(CUDNN_SDPA_ENV, "1")
        assert prefer_flash_prefill("cuda:0") is False and torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.delenv(CUDNN_SDPA_ENV)
        assert prefer_flash_prefill("cuda:0") is True and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_decodes_kv_share_does_not_depend_on_what_its_neighbours_loaded_first() -> None:
    """kvMemoryFraction is per instance (vLLM's meaning): the same decode gets the same KV whether
    its card-mates started before or after it, and never more than is free on the card."""
    from easerve_runtime.engines.hf import KV_FREE_HEADROOM_BYTES, kv_budget_bytes

    gib = 2**30
    total, own = 80 * gib, 15 * gib
    alone = kv_budget_bytes(0.45, total, free=total - own, own=own)
    after_neighbours = kv_budget_bytes(0.45, total, free=total - own - 30 * gib, own=own)
    assert alone == after_neighbours == 0.45 * total - own
    # a card the neighbours have filled gives what it has, less the headroom
    crowded = kv_budget_bytes(0.45, total, free=10 * gib, own=own)
    assert crowded == 10 * gib - KV_FREE_HEADROOM_BYTES
    assert kv_budget_bytes(0.1, total, free=total - own, own=own) < 0  # weights alone exceed the share
