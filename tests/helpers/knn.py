"""Helpers shared by the unit and distributed tests of test_knn."""

import torch

G = torch.Generator().manual_seed(0)
