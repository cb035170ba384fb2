"""Latency profiles: what each stage costs for a model on a GPU, derived from H200 measurements.

``load_profile("llava-v1.6-34b@rtx6000ada")`` returns a ``Profile``; ``list_profiles()`` lists
the names. Data lives in ``profiles/data/`` (GPU datasheets, link assumptions, model shapes and
the H200 measurements); ``calibration.py`` fits the efficiencies once; ``profile.py`` scales them.
Read docs/profiles.md for every assumption.
"""

from __future__ import annotations

from functools import cache

from easerve_runtime.profiles.calibration import calibration
from easerve_runtime.profiles.hardware import GPU, Backbone, backbone, gpu, gpu_names, load_json
from easerve_runtime.profiles.profile import TP_CHOICES, Profile

__all__ = ["GPU", "TP_CHOICES", "Backbone", "Profile", "list_profiles", "load_profile"]


def list_profiles() -> list[str]:
    models = load_json("models.json")["models"]
    return [f"{m}@{g}" for m in sorted(models) for g in gpu_names()]


@cache
def load_profile(name: str) -> Profile:
    """The profile ``<model>@<gpu>``; an unknown name is a ValueError that lists the known ones."""
    model, sep, gpu_name = str(name).partition("@")
    data = load_json("models.json")
    if not sep or model not in data["models"] or gpu_name not in gpu_names():
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(list_profiles())}")
    m = data["models"][model]
    enc = data["encoders"][m["encoder"]]
    calib = calibration()
    return Profile(
        name=f"{model}@{gpu_name}",
        model=model,
        gpu=gpu_name,
        encoder=m["encoder"],
        modality=m["modality"],
        hf_name=m["hf"],
        backbone=backbone(m["backbone"]),
        hw=gpu(gpu_name),
        tokens_per_encoder_item=int(enc["tokens_per_item"]),
        encoder_item=enc["item"],
        encoder_mode=enc["mode"],
        anyres=bool(m.get("anyres", False)),
        calib=calib,
        _enc=calib.encoders[m["encoder"]],
    )
