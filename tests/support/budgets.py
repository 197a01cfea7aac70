"""Each recipe of ``pipelines/``: the most DALI operators its GPU graph may have, as the loader
builds it (each view cut where its tail goes to the stage, ``backends/_stage``). Issue 52's
target is 10 for every recipe. The multi-view recipes (DINO's 10 views, SimCLR's 2) are over it:
each view keeps its own crop, resize, flip and layout in the graph (2026-11-28), to be brought
down, never up."""

from __future__ import annotations

TARGET = 10
MULTI_VIEW = {"ssl.py:dino", "ssl.py:simclr"}  # over the target: one crop per view

# (pipelines/ file:factory, keyword arguments) -> operators at most
GPU_OPERATORS: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {
    ("imagenet.py:train", ()): 7,
    ("imagenet.py:val", ()): 7,
    ("imagenet.py:train_v2", ()): 8,  # 77 before the stage
    ("imagenet.py:train_v2", (("auto_augment", "ra"),)): 8,  # 144
    ("imagenet.py:train_v2", (("auto_augment", "imagenet"),)): 8,  # 144
    ("imagenet.py:train_v2", (("auto_augment", "augmix"),)): 8,  # 627
    ("imagenet.py:val_v2", ()): 7,
    ("imagenet.py:train_timm", ()): 8,  # 208
    ("imagenet.py:train_3augment", ()): 8,  # 58
    ("ssl.py:dino", ()): 72,  # 903: 10 views of about 7 operators
    ("ssl.py:simclr", ()): 16,  # 182: 2 views
    ("lowres.py:train", ()): 7,
    ("lowres.py:val", ()): 7,
    ("clip.py:train", ()): 6,
    ("clip.py:val", ()): 7,
    ("segmentation.py:train", ()): 9,
    ("segmentation.py:val", ()): 7,
    ("detection.py:train", ()): 9,
    ("detection.py:val", ()): 7,
}
