"""Training (layer 4): resolve the recipe once (`resolve`), build the run and its step (`step`), the loop around it
(`loop`), the entry point that validates, checks and launches (`run`), checkpoints, metrics and the summary.

The API function is `unison.train(cfg)` (`unison.api`); this package is named ``training`` so that importing it
never shadows that function.
"""
