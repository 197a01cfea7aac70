"""The bottom floor: what every layer may use and that uses nothing of gpupipe above it.

The exception hierarchy (``_errors``), argument checks (``_validate``), the random draws every
backend shares (``_random``), geometry written once (``_geometry``), image headers
(``_imageinfo``), the batch a loader yields (``_batch``), the loader's validated options
(``_config``) and the shard writer (``_shards``). Imports no backend library.
"""
