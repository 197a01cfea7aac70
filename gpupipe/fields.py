"""A sample's fields beyond the image and its class, for ``gp.WebDataset(..., fields={...})``.

A field is given as extensions (``"txt"``, ``"json;jsn"``: their kind says how the member is
decoded) or as one of these, for its options::

    gp.WebDataset("data/{000000..000099}.tar", fields={
        "image": "jpg;png",
        "label": "cls",
        "caption": gp.fields.Text("txt", missing="empty"),
        "meta": gp.fields.Json("json", max_bytes="64KB"),
        "embedding": gp.fields.Array("npy", dtype="float32", shape=(512,)),
        "mask": gp.fields.Mask("seg.png", fill=255),  # follows the image's crops and flips
    })

Decoding is safe: ``.npy`` through NumPy's format reader (never unpickled), JSON and text with
size limits, and pickles (``pyd``, ``pth``) refused. A missing or bad field is a bad sample under
``on_error``, counted as a bad image is.
"""

from __future__ import annotations

from .core._fields import Array, Field, Image, Json, Label, Missing, Padded, Text
from .core._targets import Boxes, BoxFormat, Mask

__all__ = ["Field", "Image", "Text", "Json", "Label", "Array", "Mask", "Boxes", "BoxFormat", "Missing", "Padded"]
