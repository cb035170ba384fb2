"""Model directories in the Hugging Face layout: make tiny/full-size random ones, load stages of them.

- ``models.init``: ``easerve model init`` (a random model directory that ``from_pretrained`` loads);
- ``models.loading``: what each stage loads from a directory (encode: the tower and projector;
  prefill/decode: the language model) and the prompt side (chat template, processor, tokenizer).

torch and transformers are imported inside functions only: importing this package is cheap and
never needs a GPU stack.
"""

ARCHS = ("llava-next", "qwen2.5-vl", "qwen2-audio")
"""Architectures ``easerve model init`` writes and the torch engine serves (transformers' classes)."""
