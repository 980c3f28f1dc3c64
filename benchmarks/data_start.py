"""How long an in-memory run's data takes to be ready: the training images decoded (or read from unison's decode
cache), the augmenter, and the kNN sets decoded and kept (`unison.data.source.build_batch_source`, what every
rank of ``--data-mode memory`` runs before its first step, inside a ``--time-budget``).

    python benchmarks/data_start.py --data <train> --val <val> --knn-reference 0      # CIFAR-10: 45,000 + 5,000

To compare two versions, run it under each source tree, one after the other, alternating, on a quiet machine
(``PYTHONPATH=/other/checkout/src python benchmarks/data_start.py ...``). The first call of a new data set also
fills the decode cache; time the calls after it.
"""

from __future__ import annotations

import argparse
import time

import torch

from unison.config import TrainConfig
from unison.data import source as S
from unison.training.step import data_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--data", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--knn-reference", type=int, default=0)
    ap.add_argument("--val-subset", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(data=args.data, val=args.val, data_mode="memory", knn_reference=args.knn_reference,
                      val_subset=args.val_subset, backbone="small_cnn", progress=False)
    start = time.perf_counter()
    data = S.build_batch_source(data_spec(cfg), torch.device("cpu"), "mocov2")
    knn = data.knn
    sets = f"kNN {knn.reference.shape[0]:,} + {knn.queries.shape[0]:,} images" if knn is not None else "no kNN sets"
    print(f"data ready in {time.perf_counter() - start:.2f} s ({data.num_images:,} training images, {sets})")


if __name__ == "__main__":
    main()
