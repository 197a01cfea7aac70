"""Image–text (CLIP) training: open_clip's WebDataset recipe, in the gpupipe DSL. Each sample is an
image and its caption (img2dataset / LAION shards: ``key.jpg`` + ``key.txt``, read as open_clip's
``rename(image="jpg;png;jpeg;webp", text="txt")``), and the caption may be tokenized where the
sample is read (``gp.fields.Text(tokenizer=)``): in the torch backend's worker processes or the
DALI backend's reader threads, never in the training thread.

Load by path: ``gp.load_pipeline("pipelines/clip.py:train")(source, tokenizer=tokenize)``; each
batch gives ``images [B, 3, size, size]`` float32 (normalized with OpenAI's CLIP statistics) and
``batch["text"]``: ``[B, L]`` int64 token ids with a tokenizer (open_clip's ``tokenize`` gives
``L = 77``), else the captions as a list of str.
"""

import torch

import gpupipe as gp
from gpupipe import transforms as T

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip's OPENAI_DATASET_MEAN / STD
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def source_of(source, *, tokenizer=None, image="jpg;png;jpeg;webp", text="txt", pad=None):
    """``source`` (shard URLs or a pattern) as a WebDataset of an image and its caption, tokenized
    by ``tokenizer`` (``str -> ids``, picklable; ``pad``: a token id, for tokenizers whose lengths
    vary); a gpupipe source is taken as it is (its fields must name ``text``)."""
    if isinstance(source, gp.sources.Source):
        return source
    caption = gp.fields.Text(text, tokenizer=tokenizer, pad=pad)
    return gp.WebDataset(source, fields={"image": image, "text": caption})


def train(source, *, tokenizer=None, size=224, scale=(0.9, 1.0), pad=None):
    """open_clip's training transform: ``RandomResizedCrop(size, scale=(0.9, 1.0))`` bicubic,
    float, OpenAI's normalisation (no flip: captions say left and right)."""
    steps = [
        T.RandomResizedCrop(size, scale=scale, interpolation=T.InterpolationMode.BICUBIC),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=OPENAI_MEAN, std=OPENAI_STD),
    ]
    return gp.Pipeline(source_of(source, tokenizer=tokenizer, pad=pad), steps)


def val(source, *, tokenizer=None, size=224, pad=None):
    """open_clip's evaluation transform: the shorter side to ``size`` bicubic, the central square,
    float, OpenAI's normalisation."""
    steps = [
        T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
        T.CenterCrop(size),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=OPENAI_MEAN, std=OPENAI_STD),
    ]
    return gp.Pipeline(source_of(source, tokenizer=tokenizer, pad=pad), steps)
