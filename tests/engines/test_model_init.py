"""`easerve model init` writes directories that transformers' own from_pretrained loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.parametrize("arch", ["llava-next", "qwen2-audio", "qwen2.5-vl"])
def test_tiny_dir_loads_with_from_pretrained(model_dirs: dict[str, Path], arch: str) -> None:
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    d = model_dirs[arch]
    cfg = AutoConfig.from_pretrained(d)
    model = getattr(transformers, cfg.architectures[0]).from_pretrained(d)
    n = sum(p.numel() for p in model.parameters())
    assert 10_000 < n < 5_000_000  # tiny: a few MB
    tok = AutoTokenizer.from_pretrained(d)
    assert cfg.text_config.vocab_size >= len(tok)
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # a real, lossless tokenizer trained here
    assert (d / "chat_template.jinja").exists()
    assert json.loads((d / "easerve-model.json").read_text())["arch"] == arch


def test_llava_next_processor_expands_the_image_placeholder(model_dirs: dict[str, Path]) -> None:
    import numpy as np
    from transformers import AutoConfig, AutoProcessor

    d = model_dirs["llava-next"]
    proc = AutoProcessor.from_pretrained(d)
    cfg = AutoConfig.from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    img = (np.random.default_rng(0).random((40, 70, 3)) * 255).astype("uint8")
    out = proc(images=[img], text=[text], return_tensors="pt")
    n_img = int((out["input_ids"] == cfg.image_token_index).sum())
    assert n_img > 16  # anyres: base crop + tiles + newlines, counted by the processor itself


def test_full_size_preset_writes_config_only(tmp_path: Path) -> None:
    from easerve_operator.cli import main
    from transformers import AutoConfig

    assert main(["model", "init", "--arch", "llava-next", "--size", "7b", "-o", str(tmp_path)]) == 0
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.text_config.hidden_size == 4096 and cfg.text_config.num_hidden_layers == 32
    assert cfg.vision_config.image_size == 336
    assert not (tmp_path / "model.safetensors").exists()
