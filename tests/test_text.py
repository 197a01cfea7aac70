"""Captions and their tokenizer (``gp.fields.Text(tokenizer=)``, issue 39) and the CLIP recipe
(``pipelines/clip.py``): tokens made where the sample is read, never in the training thread,
batched as ``[B, L]`` int64 (or padded), the same on every backend."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import check_target_parity

CONTEXT = 12


def tokenize(text: str) -> np.ndarray:
    """A CLIP-like tokenizer: start 1, the caption's bytes + 3, end 2, zeros to ``CONTEXT``;
    shaped ``[1, CONTEXT]`` as open_clip's ``tokenize`` of one string."""
    ids = [1, *(b + 3 for b in text.encode()[: CONTEXT - 2]), 2]
    return np.array([ids + [0] * (CONTEXT - len(ids))], np.int64)


def where(text: str) -> list[int]:
    """Token ids saying where the tokenizer ran: the process and whether in its main thread."""
    return [len(text), os.getpid(), int(threading.current_thread() is threading.main_thread())]


def unpadded(text: str) -> torch.Tensor:
    return torch.tensor([1, *(b + 3 for b in text.encode()), 2])


def failing(text: str) -> list[int]:
    if "bad" in text:
        raise ValueError("cannot tokenize this")
    return [1, 2]


@pytest.fixture(scope="module")
def captioned(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("clip")
    with gp.ShardWriter(str(root / "c-%06d.tar"), max_count=8) as w:
        for i in range(8):
            image = encode_jpeg(synthetic_image(i, size=(40, 52)))
            w.write(f"k{i}", {"jpg": image, "txt": f"a photo {'of a cat' * i}"})
    return w.shards


def _batches(source, backend="torch", num_workers=0, size=32):
    pipe = gp.load_pipeline("pipelines/clip.py:train")(source, size=size) if not isinstance(source, gp.Pipeline) \
        else source  # fmt: skip
    with gp.Loader(pipe, 4, backend=backend, device="cpu", num_workers=num_workers, seed=2) as loader:
        return list(loader)


class TestTokenizer:
    def test_tokens_batched_as_one_tensor(self, captioned):
        source = gp.WebDataset(captioned, fields={"image": "jpg", "text": gp.fields.Text("txt", tokenizer=tokenize)})
        batches = _batches(source)
        for batch in batches:
            assert batch["text"].dtype == torch.int64 and batch["text"].shape == (4, CONTEXT)
            for key, row in zip(batch.keys, batch["text"], strict=True):
                i = int(key[1:])
                assert torch.equal(row, torch.from_numpy(tokenize(f"a photo {'of a cat' * i}")[0]))

    def test_never_in_the_training_thread(self, captioned):
        """In the torch backend's worker processes; in the DALI backend's reader threads."""
        field = gp.fields.Text("txt", tokenizer=where)
        source = gp.WebDataset(captioned, fields={"image": "jpg", "text": field})
        ran = torch.cat([b["text"] for b in _batches(source, num_workers=2)])
        assert bool((ran[:, 1] != os.getpid()).all())  # another process
        pytest.importorskip("nvidia.dali")
        ran = torch.cat([b["text"] for b in _batches(source, backend="dali")])
        assert bool((ran[:, 1] == os.getpid()).all()) and bool((ran[:, 2] == 0).all())  # a reader thread

    def test_lengths_that_vary_padded_or_listed(self, captioned):
        padded = gp.WebDataset(captioned, fields={"image": "jpg", "text": gp.fields.Text("txt", tokenizer=unpadded,
                                                                                        pad=0)})  # fmt: skip
        batch = _batches(padded)[0]
        assert isinstance(batch["text"], gp.fields.Padded)
        lengths = batch["text"].lengths[:, 0].tolist()
        assert lengths == [len(unpadded(f"a photo {'of a cat' * int(k[1:])}")) for k in batch.keys]
        listed = gp.WebDataset(captioned, fields={"image": "jpg", "text": gp.fields.Text("txt", tokenizer=unpadded)})
        assert isinstance(_batches(listed)[0]["text"], list)

    def test_a_failing_tokenizer_is_a_bad_field(self, tmp_path):
        with gp.ShardWriter(str(tmp_path / "f-%06d.tar")) as w:
            for i, text in enumerate(["good", "bad one", "good"]):
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(40, 52))), "txt": text})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "text": gp.fields.Text("txt", tokenizer=failing)})
        pipe = gp.Pipeline(source, [gp.transforms.CenterCrop(32)])
        with (
            pytest.raises(gp.SampleError, match=r"fails its tokenizer \(ValueError: cannot tokenize this\)") as e,
            gp.Loader(pipe, 3, num_workers=0, backend="torch") as loader,
        ):
            list(loader)
        assert e.value.key == "k1" and e.value.kind == gp.Damage.BAD_FIELD

    def test_options_refused(self):
        with pytest.raises(gp.ConfigError, match="tokenizer must be a function"):
            gp.fields.Text("txt", tokenizer="clip")  # type: ignore[arg-type]
        with pytest.raises(gp.ConfigError, match="pad must be None, or an int token id with a tokenizer"):
            gp.fields.Text("txt", pad=0)
        assert gp.fields.Text("txt", tokenizer=tokenize, missing="empty").empty().shape == (CONTEXT,)


class TestClipRecipe:
    """``pipelines/clip.py``: open_clip's train and val transforms, captions tokenized."""

    def test_train_and_val_on_every_backend(self, captioned):
        recipe = gp.load_pipeline("pipelines/clip.py:train")
        pipe = recipe(captioned, tokenizer=tokenize, size=32)
        out = check_target_parity(pipe.source, pipe.transforms, batch_size=4)
        assert all(b.images.shape == (4, 3, 32, 32) and b["text"].shape == (4, CONTEXT) for b in out["torch"])
        val = gp.load_pipeline("pipelines/clip.py:val")(captioned, size=32)
        batch = _batches(val)[0]
        assert batch.images.shape == (4, 3, 32, 32) and batch["text"][0].startswith("a photo")
