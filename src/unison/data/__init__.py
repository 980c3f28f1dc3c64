"""Data: in-memory datasets, streamed catalogs, counter-based randomness and batched per-sample views.

Typical training-loop use (what `unison.training.step.build_run` does through `build_batch_source`)::

    from unison.data import ViewAugmenter, global_batches, load_dataset
    ds = load_dataset("digits").to(device)
    aug = ViewAugmenter("digits", image_size=ds.image_size, mean=ds.mean, std=ds.std)
    for batch in global_batches(len(ds), global_batch=256, epoch=epoch, seed=seed):
        idx = batch[local_slice(len(batch))].to(device)   # this rank's share
        views = aug(ds.images[idx], idx, epoch=epoch, seed=seed)

Modules, bottom to top (each imports only those earlier in this list, never the training
configuration): `tensor_dataset` (`ImageTensorDataset`), `files` (bounded regular-file reads, strict labels,
the pixel limit), `samples` (the `Catalog` value), `cache`
(the cache folder), `spec` (`DataSpec` and the size rules), `subsets`, `presets`, `augment`,
`builtin` (digits, CIFAR-10), `shards` (tar shards), `pack` (images in one file), `catalog` (folders, file lists; the layout
dispatcher `open_catalog`), `memory` (decoding a catalog into memory, the cache), `datasets`
(the dispatcher `load_dataset`), `decode` / `gpu_decode` (crops of encoded images), `batches`
(`EpochOrder`, the in-memory `BatchSource`), `stream` (the streaming one), `source` (which one), `own` (the user's
own `Dataset`/`IterableDataset` and view transform: ``unison.train(cfg, dataset=..., transform=...)``); beside them
`synthetic` (random images for
checks and benchmarks) and `generated` (image files for tests and benchmarks).
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
