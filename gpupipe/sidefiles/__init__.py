"""Files gpupipe writes beside the shards, read by every loader: ``<shard>.gpupipe.json``
(``_indexfile``: what a loader needs of a shard before reading it — sample count, tar damage, each
sample's byte ranges and label) and the bad-sample lists of ``gpupipe check`` (``_mask``).

Both go through a :class:`~gpupipe.storage.Storage`, so they work for local and remote shards
alike. They sit between the storage layer and the sources that read them.
"""
