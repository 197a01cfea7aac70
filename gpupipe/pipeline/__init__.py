"""What a user declares and checks before anything runs: ``gp.Pipeline`` (a source and its
transform lists, ``_pipeline``) and ``gp.check`` (a dataset's verdicts, ``_check``). Above
``sources`` and ``transforms``; below ``plan``, ``backends`` and ``loader``."""
