"""A shard's index, the floor under the sources: one shard's samples (``_shard``: ``ShardIndex``,
``RawSample``, ``Reader``), found by the cheapest way there is (``_indexing``): the node's index
cache in DALI's format (``_indexcache``), else the index file beside the shard (``_indexfile``,
``<shard>.gpupipe.json``), else its tar headers scanned (``_tar``); and the bad-sample lists
``gpupipe check`` writes beside the shards (``_mask``).

Everything here goes through a :class:`~gpupipe.storage.Storage`, so it works for local and remote
shards alike; nothing here knows a source, a plan or a loader. A shard URL's walk goes down:
``WebDataset.index`` → ``_indexing.cached_scan`` → the cache, the side file or the scanner.
"""
