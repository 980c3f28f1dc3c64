"""Data: in-memory datasets, streamed catalogs, counter-based randomness and batched per-sample views.

Typical training-loop use (what `unison.training.step.build_run` does through `build_batch_source`)::

    from unison.data import ViewAugmenter, global_batches, load_dataset
    ds = load_dataset("digits").to(device)
    aug = ViewAugmenter("digits", image_size=ds.image_size, mean=ds.mean, std=ds.std)
    for batch in global_batches(len(ds), global_batch=256, epoch=epoch, seed=seed):
        idx = batch[local_slice(len(batch))].to(device)   # this rank's share
        views = aug(ds.images[idx], idx, epoch=epoch, seed=seed)

Modules: `datasets` (in-memory sets and `load_dataset`), `builtin` (digits, CIFAR-10),
`catalog` / `shards` (folders, file lists, tar shards), `memory` (decoding a catalog into
memory, the cache), `subsets`, `random`, `augment`, `decode` (CPU crops of encoded images),
`stream` (the streaming `BatchSource`), `batches` (the in-memory one), `source` (which one).
"""

from unison.rng import epoch_permutation, global_batches, sample_normal, sample_uniform

from .augment import PRESETS, ViewAugmenter, eval_transform
from .datasets import load_dataset
from .tensor_dataset import ImageTensorDataset

__all__ = [
    "PRESETS",
    "ImageTensorDataset",
    "ViewAugmenter",
    "epoch_permutation",
    "eval_transform",
    "global_batches",
    "load_dataset",
    "sample_normal",
    "sample_uniform",
]
