"""What an epoch holds and where a loader is in it: each rank's plan (``_plan``), a mix's plan
(``_mix``), saved positions (``_resume``), skipped samples (``_skips``) and the index and plan
settings of a loader (``_indexed``). Pure functions of the index, the seed and the epoch."""
