"""``easerve model init``: a random model directory that transformers' own ``from_pretrained`` loads.

Why: the machines that build and test EAServe reach no model hub, yet the torch engine must be
tested through the real loading code (``from_pretrained`` of a directory, the model's processor,
tokenizer and chat template). So we write such a directory ourselves:

- ``config.json`` + ``model.safetensors``: the architecture's own config class and model class,
  random weights saved with the library's ``save_pretrained`` (``--size tiny``: a few MB);
- a byte-level BPE tokenizer trained here with the ``tokenizers`` library on a small built-in
  corpus, with the architecture's special tokens (image/audio placeholders, chat markers);
- the processor (image processor or feature extractor) config and a ChatML chat template that
  places each media part's placeholder where the model's processor expects it.

``--size 7b`` (and ``34b`` for LLaVA-NeXT) writes the full-size *config* only, plus tokenizer and
processor (``randomWeights: true`` specs materialise weights at load time): a 7B checkpoint of
random numbers would be 15 GB of disk for no information.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from easerve_runtime.models import ARCHS

SIZES = ("tiny", "7b", "34b")
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")
EOS = "<|endoftext|>"
PAD = "<|pad|>"

# what the chat template writes for one media part, per architecture (the processor expands it)
PLACEHOLDERS: dict[str, dict[str, str]] = {
    "llava-next": {"image": "<image>\n"},
    "qwen2.5-vl": {
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
    },
    "qwen2-audio": {"audio": "Audio {{ loop.index }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"},
}
SPECIAL: dict[str, list[str]] = {
    "llava-next": ["<image>"],
    "qwen2.5-vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "qwen2-audio": ["<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"],
}

_CORPUS = """The quick brown fox jumps over the lazy dog. A picture shows a cat sitting on a red mat.
What is in this image? Describe the scene in detail. The photo contains two people walking in a park.
Listen to the audio clip and tell me what you hear. A man is speaking about the weather tomorrow.
There is a car, a tree, a house and a small boat on the lake. The sky is blue and the sun is bright.
Please answer briefly. Yes, no, maybe. One two three four five six seven eight nine ten.
The video shows a dog running after a ball, then a child laughing. Numbers: 0 1 2 3 4 5 6 7 8 9.
"""


def chat_template(arch: str) -> str:
    """A ChatML template; each media part becomes the architecture's placeholder (see PLACEHOLDERS)."""
    ph = PLACEHOLDERS[arch]
    media = ""
    for kinds, key in (
        (("image", "image_url"), "image"),
        (("audio", "input_audio", "audio_url"), "audio"),
        (("video", "video_url"), "video"),
    ):
        if key in ph:
            cond = " or ".join(f"part.type == '{k}'" for k in kinds)
            media += f"{{% elif {cond} %}}{ph[key]}"
    return (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.content is string %}{{ message.content }}"
        "{% else %}{% for part in message.content %}"
        "{% if part.type == 'text' %}{{ part.text }}" + media + "{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def train_tokenizer(arch: str, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained locally (no hub), wrapped as a fast transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, PAD, *CHAT_MARKERS, *SPECIAL[arch]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    extra: dict[str, Any] = {}
    if arch == "qwen2.5-vl":
        extra = {"extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(specials[2:]),
        model_max_length=32768,
        **extra,
    )


def _llama_text(size: str, vocab: int) -> dict[str, Any]:
    if size == "tiny":
        return dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
        )
    if size == "7b":  # Mistral-7B / LLaVA-1.6-7B backbone shape (the H200 reference: 131,072 B/token KV)
        return dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=max(vocab, 32064), max_position_embeddings=32768,
        )
    # 34b: the LLaVA-1.6-34B backbone shape
    return dict(
        hidden_size=7168, intermediate_size=20480, num_hidden_layers=60, num_attention_heads=56,
        num_key_value_heads=8, vocab_size=max(vocab, 64000), max_position_embeddings=32768,
    )


def build(arch: str, size: str = "tiny") -> tuple[Any, Any, Any]:
    """(config, processor, tokenizer) of ``arch`` at ``size``; nothing is written."""
    if arch not in ARCHS:
        raise ValueError(f"--arch: unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    if size not in SIZES or (size == "34b" and arch != "llava-next"):
        raise ValueError(f"--size: {size!r} is not a preset of {arch} (tiny, 7b{', 34b' if arch == 'llava-next' else ''})")
    tok = train_tokenizer(arch)
    vocab = len(tok)
    eos = tok.convert_tokens_to_ids(EOS)
    pad = tok.convert_tokens_to_ids(PAD)
    template = chat_template(arch)
    tiny = size == "tiny"
    if arch == "llava-next":
        from transformers import LlavaNextConfig, LlavaNextImageProcessor, LlavaNextProcessor

        img, patch = (32, 8) if tiny else (336, 14)
        pins = [[img, 2 * img], [2 * img, img], [2 * img, 2 * img]]
        if not tiny:
            pins += [[3 * img, img], [img, 3 * img]]
        vision = (
            dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, image_size=img, patch_size=patch, projection_dim=32)
            if tiny
            else dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=16, image_size=img, patch_size=patch, projection_dim=768)
        )
        text = dict(model_type="llama", bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, **_llama_text(size, vocab))
        cfg = LlavaNextConfig(
            vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
            image_grid_pinpoints=pins, vision_feature_layer=-2, vision_feature_select_strategy="default",
        )
        ip = LlavaNextImageProcessor(
            size={"shortest_edge": img}, crop_size={"height": img, "width": img}, image_grid_pinpoints=pins
        )
        proc = LlavaNextProcessor(
            image_processor=ip, tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
            chat_template=template, image_token="<image>", num_additional_image_tokens=1,  # the CLS token
        )
    elif arch == "qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

        if tiny:
            text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          fullatt_block_indexes=[1], window_size=56)
            mrope = [2, 3, 3]  # sums to head_dim / 2 = 8
        else:  # Qwen2.5-VL-7B
            text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=max(vocab, 152064), max_position_embeddings=32768)
            vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                          fullatt_block_indexes=[7, 15, 23, 31], window_size=112)
            mrope = [16, 24, 24]
        text.update(
            bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        )
        cfg = Qwen2_5_VLConfig(
            text_config=text, vision_config=vision,
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        )
        px = (56 * 56, 112 * 112) if tiny else (256 * 28 * 28, 1280 * 28 * 28)
        ip = Qwen2VLImageProcessor(min_pixels=px[0], max_pixels=px[1], patch_size=14, merge_size=2, temporal_patch_size=2)
        vp = qwen_video_processor()
        proc = (
            Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)
            if vp is not None
            else SavedParts(tok, ip, template, QWEN_VIDEO_DEFAULTS)
        )
    else:
        from transformers import Qwen2AudioConfig, Qwen2AudioProcessor, WhisperFeatureExtractor

        if tiny:
            audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=128)
            text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
        else:  # Qwen2-Audio-7B: Whisper-large-v3 encoder + Qwen-7B backbone
            audio = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                         num_mel_bins=128)
            text = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=max(vocab, 156032), max_position_embeddings=8192)
        text.update(model_type="qwen2", bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
        cfg = Qwen2AudioConfig(
            audio_config=dict(model_type="qwen2_audio_encoder", **audio), text_config=text,
            audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"),
        )
        fe = WhisperFeatureExtractor(feature_size=128)
        proc = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=template)
    cfg.eos_token_id = eos
    cfg.pad_token_id = pad
    return cfg, proc, tok


QWEN_VIDEO_DEFAULTS = {
    "video_processor_type": "Qwen2VLVideoProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 128 * 28 * 28,
    "max_pixels": 768 * 28 * 28,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}


def qwen_video_processor() -> Any:
    """Qwen2-VL's video processor, or None without torchvision (it is torchvision-only in transformers 5)."""
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return Qwen2VLVideoProcessor()
    except ImportError:
        return None


class SavedParts:
    """A processor's parts saved one by one, where the processor class cannot be built here.

    Qwen2.5-VL's processor insists on its torchvision-only video processor; on a machine without
    torchvision we write the same files its ``save_pretrained`` writes (tokenizer, image processor,
    video processor config, chat template, processor class), so a GPU box loads it unchanged.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, template: str, video: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.template = template
        self.video = video

    def save_pretrained(self, out: Path) -> None:
        self.tokenizer.save_pretrained(out)
        self.image_processor.save_pretrained(out)
        (out / "chat_template.jinja").write_text(self.template)
        (out / "video_preprocessor_config.json").write_text(json.dumps(self.video, indent=2) + "\n")
        (out / "processor_config.json").write_text(
            json.dumps({"processor_class": self.video["processor_class"]}, indent=2) + "\n"
        )


def model_class(cfg: Any) -> Any:
    """The transformers class that owns ``cfg``'s architecture (image/audio-text-to-text)."""
    import transformers

    arch = (getattr(cfg, "architectures", None) or [None])[0]
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)
    name = {
        "llava_next": "LlavaNextForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    }.get(cfg.model_type)
    if name is None:
        raise ValueError(f"config.model_type {cfg.model_type!r}: not an architecture the torch engine serves")
    return getattr(transformers, name)


def init_model(arch: str, out: str | Path, size: str = "tiny", seed: int = 0, weights: bool | None = None) -> Path:
    """Write the model directory; weights by default only for ``tiny`` (see the module docstring)."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, proc, _tok = build(arch, size)
    cls = model_class(cfg)
    cfg.architectures = [cls.__name__]
    if weights is None:
        weights = size == "tiny"
    if weights:
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        model.generation_config.eos_token_id = cfg.eos_token_id
        model.generation_config.pad_token_id = cfg.pad_token_id
        model.save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    proc.save_pretrained(out)
    (out / "easerve-model.json").write_text(
        json.dumps({"arch": arch, "size": size, "weights": bool(weights), "seed": seed}, indent=2) + "\n"
    )
    return out
