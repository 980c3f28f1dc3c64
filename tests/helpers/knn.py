"""Helpers of tests/eval/test_knn.py, for its in-process tests and those that start processes."""

import torch

G = torch.Generator().manual_seed(0)
