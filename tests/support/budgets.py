"""Each recipe of ``pipelines/``: the most DALI operators its GPU graph may have, as the loader
builds it (each view cut where its tail goes to the stage, ``backends/_stage``). Issue 52's
target is 10 for every recipe. The multi-view recipes (DINO's 10 views, SimCLR's 2) are over it:
each view keeps its own crop, resize, and flip with layout in the graph (2026-11-28), to be
brought down, never up."""

from __future__ import annotations

TARGET = 10
MULTI_VIEW = {"ssl.py:dino", "ssl.py:simclr"}  # over the target: one crop per view

# (pipelines/ file:factory, keyword arguments) -> operators at most
GPU_OPERATORS: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {
    ("imagenet.py:train", ()): 7,
    ("imagenet.py:val", ()): 7,
    ("imagenet.py:train_v2", ()): 7,  # 77 before the stage
    ("imagenet.py:train_v2", (("auto_augment", "ra"),)): 7,  # 144
    ("imagenet.py:train_v2", (("auto_augment", "imagenet"),)): 7,  # 144
    ("imagenet.py:train_v2", (("auto_augment", "augmix"),)): 7,  # 627
    ("imagenet.py:val_v2", ()): 7,
    ("imagenet.py:train_timm", ()): 7,  # 208
    ("imagenet.py:train_3augment", ()): 7,  # 58
    ("ssl.py:dino", ()): 62,  # 903: 10 views of 6 (crop arguments 2, slice, resize, flip argument, flip+layout)
    ("ssl.py:simclr", ()): 14,  # 182: 2 views
    ("lowres.py:train", ()): 7,
    ("lowres.py:val", ()): 7,
    ("clip.py:train", ()): 6,
    ("clip.py:val", ()): 7,
    ("segmentation.py:train", ()): 9,
    ("segmentation.py:val", ()): 7,
    ("detection.py:train", ()): 9,
    ("detection.py:val", ()): 7,
}

# The device stage of each stage recipe (every view's tail, MixUp/CutMix left out), batched the
# GPU's way: the most device operations (kernel launches, roughly) per batch of 256, counted on the
# meta device by ``bench/stage_launches.py`` (``bench/results/2026-11-29-stage-launches-cpu.md``).
# Its launches made the stage host-bound on the H200 (2026-11-28): brought down, never up.
STAGE_LAUNCHES: dict[str, int] = {
    "v2 (TrivialAugmentWide)": 120,  # 180 at 201f786
    "v2 RandAugment": 219,  # 331
    "timm rand-m9": 272,  # 474
    "v2 augmix": 337,  # 1,489
    "dino (2 + 8 views)": 1150,  # 4,623
}
