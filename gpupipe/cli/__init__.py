"""The ``gpupipe`` command (``python -m gpupipe``) and the modules only it uses: ``_main`` (the
argument parser and the small commands), ``_doctor``, ``_bench`` and ``_inspect``. The library
never imports this package."""
