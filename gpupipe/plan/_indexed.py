"""What a loader knows of its source's samples: the index, the samples left out, the plan's
settings and — for a source that grows between epochs — the listing they were made from. Made
when the loader is built, and again at an epoch whose listing differs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..core._config import LoaderConfig
from ..core._errors import ConfigError
from ..runtime import _dist
from ..sources import Index, Source
from ._plan import PlanSpec, mask_digest
from ._planner import Planner, planner_for
from ._prefetch import prepare_remote
from ._skips import Skips

__all__ = ["Indexed", "index_source", "listing_of"]


@dataclasses.dataclass(frozen=True)
class Indexed:
    """``index`` of the source (of ``listing``, where it grows); ``excluded``, its samples known
    bad (sorted); ``spec``, the plan's settings for it; ``planner``, its kind's planner."""

    index: Index
    excluded: np.ndarray
    spec: PlanSpec
    planner: Planner
    listing: Any = None


def listing_of(source: Source, topo: _dist.Topology, device: torch.device) -> Any:
    """``source.listing()`` as every rank sees it: rank 0's, under torch.distributed."""
    listing = source.listing()
    return None if listing is None else _dist.agreed(topo, listing, device=device)


def index_source(
    source: Source,
    listing: Any,
    config: LoaderConfig,
    topo: _dist.Topology,
    *,
    seed: int,
    device: torch.device,
    skips: Skips,
) -> Indexed:
    """Indexes ``source`` (of ``listing``), records what it leaves out in ``skips``, readies a
    remote storage, and checks that every rank made the same plan settings."""
    index = source.with_listing(listing).index(rank=topo.rank, world_size=topo.world_size, on_error=config.on_error)
    try:
        index.max_image_bytes = config.max_image_bytes  # type: ignore[assignment]  # an int after validation
        excluded = index.bad
        skips.known_before(index)
        prepare_remote(
            index,
            at_once=config.interleave if config.shuffle else 1,
            ahead=config.remote_ahead(),
            local_ranks=_dist.ranks_per_node() or 1,
        )
        if len(index) - len(excluded) <= 0:
            raise ConfigError(f"Loader: the source has no samples: {source!r}")
        planner = planner_for(index, excluded)
        spec = PlanSpec(
            num_samples=planner.num_samples,
            world_size=topo.world_size,
            batch_size=config.batch_size,
            drop_last=config.drop_last,
            shuffle=config.shuffle,
            shuffle_buffer=config.shuffle_buffer,
            interleave=config.interleave,
            mask=mask_digest(excluded),
            mix=planner.digest,
            repeats=config.repeats,
        )
        if planner.digest and config.repeats > 1:
            raise ConfigError("Loader: repeats takes one source, not a gp.Mix (a Mix repeats by its own counts)")
        _dist.require_same(
            topo,
            "the loader's plan",
            {**spec.as_dict(), "seed": seed, "shards": len(index.shards)},
            device=device,
        )
    except BaseException:
        index.close()
        raise
    return Indexed(index, excluded, spec, planner, listing)
