"""The processor's inputs for a micro-batch of images, with the prompts tokenized before their
image placeholders are expanded.

Why: a processor expands each image's placeholder into one token per image feature (``<image>``
x 2,900 for a 1080p LLaVA-NeXT image) in the *text*, then tokenizes that text. On the host that
was most of the encode stage's processor time: tokenizing 16 expanded LLaVA-NeXT prompts took
32 ms on this CPU machine, where the whole micro-batch's GPU work is ~74 ms on an H200, and the
stage was host-bound (``docs/benchmarks.md``, run 10). A run of one special token tokenizes to
that token repeated, and special tokens are split off before the rest of the text is tokenized,
so tokenizing the short prompt and splicing each image's run into the ids gives the same ids
(tested against the processor). Everything else is the processor's own: its kwargs merging, its
image path (``_process_images``: the image processor and ``replace_image_token``, which says how
many tokens each image takes), its tokenizer and padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def expanded_inputs(processor: Any, texts: Sequence[str], images: Sequence[Any], **kwargs: Any) -> Any | None:
    """``processor(text=texts, images=images, return_tensors="pt", padding=True, **kwargs)``, the
    same tensors, without tokenizing the expanded text. None when this processor's replacement is
    not a run of its image token, or the prompts' placeholders do not match the images (the caller
    then calls the processor, which says what is wrong)."""
    from transformers import BatchFeature

    token = getattr(processor, "image_token", None)
    token_id = getattr(processor, "image_token_id", None)
    if not token or token_id is None or not hasattr(processor, "_process_images"):
        return None
    merged = processor._merge_kwargs(processor.valid_processor_kwargs,
                                     tokenizer_init_kwargs=processor.tokenizer.init_kwargs,
                                     return_tensors="pt", padding=True, **kwargs)
    processed, replacements = processor._process_images(list(images), **merged["images_kwargs"])
    counts = []
    for rep in replacements:
        n = len(rep) // len(token)
        if rep != token * n:
            return None
        counts.append(n)
    text_kwargs = dict(merged["text_kwargs"])
    padding = text_kwargs.pop("padding", False)
    tensors = text_kwargs.pop("return_tensors", None)
    want_types = text_kwargs.pop("return_mm_token_type_ids", False)
    if text_kwargs.pop("return_text_replacement_offsets", False) or any(
            text_kwargs.get(k) for k in ("truncation", "max_length", "pad_to_multiple_of")):
        return None  # an output or a length rule this path does not make: the processor does
    short = processor.tokenizer(list(texts), **text_kwargs)
    if set(short.keys()) - {"input_ids", "attention_mask"}:
        return None  # e.g. token_type_ids: the processor returns what its tokenizer returns
    runs = iter(counts)
    rows: list[Any] = []
    for row in short["input_ids"]:
        row_t = torch.as_tensor(row, dtype=torch.long)
        at = (row_t == token_id).nonzero().flatten().tolist()
        pieces, start = [], 0
        for i in at:
            n = next(runs, None)
            if n is None:
                return None
            pieces += [row_t[start:i], torch.full((n,), token_id, dtype=torch.long)]
            start = i + 1
        rows.append(torch.cat([*pieces, row_t[start:]]))
    if next(runs, None) is not None:
        return None
    padded = _pad(processor.tokenizer, rows, padding)
    if want_types:  # Qwen2.5-VL's processor returns each token's modality, by its own rule
        padded["mm_token_type_ids"] = torch.as_tensor(processor.create_mm_token_type_ids(padded["input_ids"]))
    if tensors != "pt":
        padded = {k: v.tolist() for k, v in padded.items()}
    data = {**padded, **processed}
    data = {k: v for k, v in data.items() if k not in getattr(processor, "unused_input_names", ())}
    return BatchFeature(data, tensor_type=tensors)


def _pad(tokenizer: Any, rows: Sequence[Any], padding: Any) -> dict[str, Any]:
    """``tokenizer.pad`` of id tensors (its pad id and side, an attention mask of ones over the ids),
    without turning ~3,000-token rows into Python lists and back (half of the time saved above)."""
    longest = max((len(r) for r in rows), default=0)
    if padding in (False, "do_not_pad") and len({len(r) for r in rows}) > 1:
        raise ValueError("rows of different lengths need padding")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        cut = slice(longest - len(r), longest) if tokenizer.padding_side == "left" else slice(0, len(r))
        ids[i, cut] = r
        mask[i, cut] = 1
    return {"input_ids": ids, "attention_mask": mask}
