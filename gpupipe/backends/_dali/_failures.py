"""What a DALI failure means: the device's, the memory's, or a sample's — found by decoding the
candidates with gpupipe's own decoder in a child process, since DALI's errors name no sample."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ...core._errors import SampleError
from ...sources import RawSample

__all__ = ["device_failure", "explain_failure"]


# DALI's own allocation failures (libdali_core: "Can't allocate %zu bytes on device %d.", "CUDA
# allocation failed"), CUDA's and C++'s. A decoder's status (nvJPEG, nvImageCodec) is not here: a bad
# bitstream is one, and the sample search below tells the two apart.
_OUT_OF_MEMORY = ("out of memory", "can't allocate", "allocation failed", "cudaerrormemoryallocation",
                  "cuda_error_out_of_memory", "std::bad_alloc", "cudabadalloc")  # fmt: skip
_CUDA_FAILURE = ("cuda error", "cudaerror", "cuda_error", "cuda runtime error")


def _detail(error: BaseException) -> str:
    """The line of DALI's message that says what failed: an exception's (``ValueError: ...``, the
    last), else the last naming a failure or an error (not a traceback's file line: a path may hold
    "error"), else the first."""
    lines = str(error).strip().splitlines() or ["(no message)"]
    raised = [line for line in lines if re.search(r"\b[A-Za-z_]\w*(Error|Exception|Failure|Interrupt):", line)]
    if raised:
        return raised[-1].strip()[:300]
    said = [line for line in lines if ("failure" in line or "rror" in line) and not re.match(r"\s*(File |/)", line)]
    return (said[-1] if said else lines[0]).strip()[:300]


def device_failure(error: BaseException, *, batch: int) -> Exception | None:
    """The error to raise if DALI's failure is the device's or the memory's (never bad data)."""
    lowered = str(error).lower()
    if any(marker in lowered for marker in _OUT_OF_MEMORY):
        return torch.OutOfMemoryError(f"DALI ran out of memory on batch {batch}: {_detail(error)}")
    if any(marker in lowered for marker in _CUDA_FAILURE):
        return RuntimeError(f"DALI failed on the device on batch {batch}: {_detail(error)}")
    return None


def explain_failure(error: RuntimeError, candidates: Iterable[RawSample], *, batch: int, ahead: int) -> Exception:
    """What a DALI failure means. DALI's errors name no sample, so:

    - out of memory (GPU or host) is ``torch.OutOfMemoryError``, as torch's own, never bad data;
    - another CUDA failure is a ``RuntimeError`` about the device;
    - otherwise the candidate samples are decoded with gpupipe's own decoder, in a child process
      (``gpupipe.runtime._decode.verdicts``): the first it rejects is the ``SampleError``, naming shard and key;
    - if it reads them all, a ``RuntimeError``: not known to be bad data.
    """
    from ...runtime._decode import verdicts

    detail = _detail(error)
    failure = device_failure(error, batch=batch)
    if failure is not None:
        return failure
    raws = list(candidates)
    for bad in verdicts([(raw.data, raw.shard, raw.key) for raw in raws], max_pixels=None):
        if bad is not None:
            return SampleError(f"{bad} (DALI: {detail})", shard=bad.shard, key=bad.key, kind=bad.kind)
    which = f"batch {batch} (or one of the {ahead} after it), whose samples" if ahead else (
        f"batch {batch}, whose samples each pass the graph alone and")  # fmt: skip
    return RuntimeError(
        f"DALI failed on {which} gpupipe's decoder reads fine, so the failure is not known to be bad data: {detail}"
    )
