"""The built-in sets' training images, known before they are loaded (the pre-flight and `unison plan` check a batch
and a step of ``--grad-sync-every`` micro-batches against them): the numbers equal what the loaders give."""

from __future__ import annotations

from unison.data.builtin import load_digits
from unison.data.spec import BUILTIN, BUILTIN_IMAGES


def test_the_digits_count_is_the_loaded_training_split():
    assert set(BUILTIN_IMAGES) == set(BUILTIN)
    assert BUILTIN_IMAGES["digits"] == len(load_digits("train"))
    assert BUILTIN_IMAGES["cifar10"] == 50_000   # torchvision's CIFAR10(train=True), the official training split
