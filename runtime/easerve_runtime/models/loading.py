"""Load one stage of a model directory: only the weights that stage runs, through transformers.

Why the depth-zero trick: transformers' multimodal classes (``LlavaNextForConditionalGeneration``
...) own both towers, and their ``from_pretrained`` is the only loader that knows each
checkpoint's key layout, tied weights and the buffers computed at construction (RoPE
frequencies, position ids). So each stage loads the *same class* from the *same directory* with
the other tower's depth set to 0 in the config: the loader then never reads those layers' tensors
(it skips keys the model does not have), and the stage holds only what it runs:

- ``encode``: the vision/audio tower and the projector (the text model at depth 0 with an 8-row
  vocabulary, a few KB);
- ``lm`` (prefill and decode): the language model and LM head (the tower at depth 0: its patch
  embedding and norms remain, ~1 % of a CLIP ViT-L).

``random_weights`` builds the same stage from the config alone (benchmarks; no safetensors).
Remote code (``auto_map`` in the config, e.g. Ultravox) is refused unless the spec opts in with
``spec.model.trustRemoteCode``: that code runs with the worker's privileges.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("easerve.models")

STAGES = ("encode", "lm")

# model_type -> (attribute of the config holding the tower config, its depth field, mm token field)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "llava_next": ("vision_config", "num_hidden_layers", "image_token_index"),
    "qwen2_audio": ("audio_config", "encoder_layers", "audio_token_index"),
    "qwen2_5_vl": ("vision_config", "depth", "image_token_id"),
}


class ModelDirError(ValueError):
    """A model directory the torch engine cannot serve; the message names the spec field."""


def read_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    try:
        return dict(json.loads(p.read_text()))
    except OSError as exc:
        raise ModelDirError(f"spec.model.path: {path}: no readable config.json ({exc.strerror})") from None


def check_remote_code(path: str | Path, trust_remote_code: bool) -> None:
    raw = read_config(path)
    if raw.get("auto_map") and not trust_remote_code:
        raise ModelDirError(
            f"spec.model.trustRemoteCode: {path} needs the directory's own Python code "
            f"(auto_map: {sorted(raw['auto_map'])}); set it to true only if you trust that code"
        )


def resolve_dtype(name: str | None, device: str) -> Any:
    """bf16 on CUDA, float32 on CPU unless told (CPU tests compare against float32 ``generate``)."""
    import torch

    if name:
        return getattr(torch, name)
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


@dataclass
class LoadedStage:
    """One stage's model plus what it needs around it."""

    model: Any
    config: Any
    family: str
    mm_token_id: int
    device: str
    dtype: Any

    @property
    def text_config(self) -> Any:
        return self.config.text_config


def truncate_to_feature_layer(cfg: Any) -> int | None:
    """Cut a LLaVA-style vision tower after the last layer whose hidden state the model reads.

    Why: LLaVA-NeXT takes its image features from ``vision_feature_layer`` (-2: the penultimate
    of CLIP ViT-L's 24 layers), yet the library's tower runs every layer and drops the last one's
    output, 1/24 of the encoder's GPU time spent on nothing (vLLM cuts its CLIP tower the same
    way). The config's feature layer becomes the same layer counted from the input (absolute
    indices mean the same hidden state in the shorter tower), so the features are bit for bit the
    ones the full tower selects, and the stage loads none of the unused layer's weights. Returns
    the new depth, or None where the family has no such field."""
    layer = getattr(cfg, "vision_feature_layer", None)
    vision = getattr(cfg, "vision_config", None)
    depth = getattr(vision, "num_hidden_layers", None)
    if layer is None or not isinstance(depth, int) or depth <= 0:
        return None
    layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
    absolute = [int(x) if x >= 0 else depth + 1 + int(x) for x in layers]
    if any(not 0 <= a <= depth for a in absolute):
        raise ModelDirError(f"vision_feature_layer {layer!r} is outside the {depth}-layer vision tower")
    cfg.vision_feature_layer = absolute if isinstance(layer, (list, tuple)) else absolute[0]
    vision.num_hidden_layers = max(absolute)
    return int(vision.num_hidden_layers)


def load_stage(
    path: str | Path,
    stage: str,
    *,
    device: str = "cpu",
    dtype: Any = None,
    random_weights: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> LoadedStage:
    """The model of ``stage`` (``encode`` or ``lm``) from the directory at ``path``, in eval mode."""
    import torch
    import transformers
    from transformers import AutoConfig

    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    check_remote_code(path, trust_remote_code)
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    fam = FAMILIES.get(cfg.model_type)
    if fam is None:
        raise ModelDirError(
            f"spec.model.path: {path}: model_type {cfg.model_type!r} is not served by the torch engine "
            f"(known: {', '.join(sorted(FAMILIES))})"
        )
    tower_attr, depth_field, mm_field = fam
    if stage == "encode":
        cfg.text_config.num_hidden_layers = 0
        cfg.text_config.vocab_size = 8
        truncate_to_feature_layer(cfg)
    else:
        setattr(getattr(cfg, tower_attr), depth_field, 0)
    mm_token_id = int(getattr(cfg, mm_field))
    arch = (cfg.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ModelDirError(f"spec.model.path: {path}: architecture {arch!r} is not a transformers class")
    dt = resolve_dtype(None, device) if dtype is None else dtype
    if random_weights:
        try:  # initialise straight on the device (a 7B model: seconds on a GPU, minutes on a CPU)
            with torch.device(device):
                model = cls._from_config(cfg, dtype=dt, attn_implementation=attn_implementation)
        except (RuntimeError, ValueError, TypeError) as exc:
            log.warning("random init on %s failed (%r); initialising on the CPU", device, exc)
            model = cls._from_config(cfg, dtype=dt, attn_implementation=attn_implementation).to(device)
    else:
        import transformers.utils.logging as tlog

        verbosity = tlog.get_verbosity()
        tlog.set_verbosity_error()  # the skipped tower's keys are expected, not news
        try:
            model = cls.from_pretrained(
                path,
                config=cfg,
                dtype=dt,
                ignore_mismatched_sizes=stage == "encode",
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
        finally:
            tlog.set_verbosity(verbosity)
        model = model.to(device)  # device_map needs accelerate; the stage fits one device (TP 1)
    model.eval()
    model.requires_grad_(False)
    return LoadedStage(model, cfg, cfg.model_type, mm_token_id, device, dt)


def load_processor(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The directory's processor (tokenizer + image processor / feature extractor + chat template)."""
    from transformers import AutoProcessor

    check_remote_code(path, trust_remote_code)
    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ImportError as exc:
        if read_config(path).get("model_type") == "qwen2_5_vl":
            try:
                return qwen_image_processor(path)
            except ImportError:
                pass
        raise ModelDirError(f"spec.model.path: {path}: its processor needs a package missing here: {exc}") from None


def qwen_image_processor(path: str | Path) -> Any:
    """Qwen2.5-VL's own processor class with its PIL image processor and no video processor.

    Why: in transformers 5 the directory's processor loads torchvision-only image and video
    processors, and PyPI's torchvision is a CUDA build that does not load beside a CPU torch. The
    library also ships a PIL image processor (``Qwen2VLImageProcessorPil``) that computes the same
    patches; with it, the library's processor class still does the chat template and the
    placeholder expansion (no copy of either here). Videos are refused by the encode engine on
    such a machine (``has_video``), with a message that names the missing package."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        has_video = False

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = AutoTokenizer.from_pretrained(path)
    template = Path(path) / "chat_template.jinja"
    return ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
        tokenizer=tok,
        video_processor=None,
        chat_template=template.read_text() if template.exists() else getattr(tok, "chat_template", None),
    )


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    check_remote_code(path, trust_remote_code)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def stop_token_ids(path: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, else the tokenizer's."""
    p = Path(path) / "generation_config.json"
    ids: list[int] = []
    if p.exists():
        eos = json.loads(p.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(int(i) for i in ids)


class Detokenizer:
    """Incremental detokenization: each new token's text delta, UTF-8 safe.

    Decoding token by token splits multi-byte characters and merges spaces wrongly, so we decode
    the whole sequence so far and emit what it adds, holding back a trailing replacement char
    (an incomplete byte sequence) until the next token completes it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.sent) :] if text.startswith(self.sent) else text
        self.sent = text
        return delta
