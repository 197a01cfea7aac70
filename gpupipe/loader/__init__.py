"""The top floor of the library: ``gp.Loader`` (``_loader``), the attributes trainers read on it
(``_trainers``), ``gp.tune`` (``_tune``: measuring settings) and the tune records loaders take
(``_records``)."""
