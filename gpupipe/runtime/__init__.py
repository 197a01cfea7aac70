"""Processes and devices: who this process is (``_dist``: rank, world, worker, in one place),
the child processes gpupipe starts (``_children``), the decoder sandbox (``_sandbox``, ``_decode``)
and the nvJPEG library (``_nvjpeg``). Above ``core``; below everything that reads data.

Imports nothing at package import: ``gpupipe/__init__`` preloads nvJPEG from here before
torchvision is imported.
"""
