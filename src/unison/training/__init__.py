"""Training (layer 6): resolve the run and its recipe once (`resolve`), build the run and its step (`step`), the
trainer around it (`trainer`), the entry point that validates, checks and launches (`run`), checkpoints, metrics
and the summary.

The API function is `unison.train(cfg)` (`unison.api`); this package is named ``training`` so that importing it
never shadows that function.
"""
