"""FLOPs of one training step, and the fraction of an accelerator's bf16 peak a measured step reaches.

`training_step_flops` counts the matrix FLOPs (convolutions, matmuls, bmm, attention)
of one forward + backward of a method at a given batch with PyTorch's own
`torch.utils.flop_counter.FlopCounterMode`, on the ``meta`` device: shapes only, no
memory, no compute, so it is instant even for ResNet-50 at batch 512. Elementwise ops
(batch norm, ReLU, the optimizer) are not counted, as in the usual model-FLOPs
utilisation (MFU) figure. The count does not depend on the number of workers: W
workers at B/W each do the work of one worker at B.

`BF16_PEAK_TFLOPS` holds the dense bf16 tensor-core peak of common data-centre GPUs from
NVIDIA's datasheets (their headline "with sparsity" figures are twice these). A GPU that
is not listed reports its achieved TFLOP/s without a fraction, unless ``--peak-tflops``
names its peak. CPUs have no entry: the peak of a CPU depends on its clock, cores
and vector units, so there `matmul_rate` *measures* the machine's dense fp32 matrix rate (``torch.mm``
at 1024 and 2048, the sides' thread count) in the same run, and a step's rate is given as a fraction of it.

Example::

    flops = training_step_flops("simclr", "resnet18", batch=512, image_size=32)
    tflops = flops * steps / train_time_s / 1e12
    fraction = tflops / bf16_peak_tflops(torch.cuda.get_device_name())   # None if unknown
"""

from __future__ import annotations

import torch

# Substring of `torch.cuda.get_device_name()` -> dense bf16 TFLOPS. Checked in order: the
# first match wins, so the specific names ("H100 PCIe", "L40S") come before the general ones.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.4),      # SXM5 (device name "NVIDIA H100 80GB HBM3")
    ("H200", 989.4),      # SXM: the H100's compute with more memory
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def bf16_peak_tflops(device_name: str | None) -> float | None:
    """Dense bf16 peak of the named GPU, or None when it is not in `BF16_PEAK_TFLOPS`."""
    if not device_name:
        return None
    for key, peak in BF16_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def training_step_flops(method: str, backbone: str, batch: int, image_size: int) -> int:
    """Matrix FLOPs of one forward + backward of `method` on `backbone` at global batch `batch`.

    The model is the production one (`unison.training.step.build_method`: backbone, method and its
    default hyper-parameters), built on the meta device; two views at `image_size`."""
    from torch.utils.flop_counter import FlopCounterMode

    from unison.config import TrainConfig
    from unison.training.model import build_method

    cfg = TrainConfig(method=method, backbone=backbone)
    with torch.device("meta"):
        model = build_method(cfg, total_steps=1, dtype=torch.float32, device=torch.device("meta"))
        views = [torch.randn(batch, 3, image_size, image_size) for _ in range(2)]
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        model(views).backward()
    return int(counter.get_total_flops())


def matmul_rate(threads: int, sizes: tuple[int, ...] = (1024, 2048), repeats: int = 5,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the best dense ``torch.mm`` in `dtype` (n x n by n x n, 2 n^3 FLOPs) over `sizes`, each the best of
    `repeats` after one warm-up, with `threads` torch threads: what this machine's matrix units reach now (on a GPU
    in bf16 at 8192: the card's measured bf16 rate, the denominator of its MFU)."""
    import time

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        for n in sizes:
            a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            for _ in range(repeats):
                started = time.perf_counter()
                torch.mm(a, b)
                if device == "cuda":
                    torch.cuda.synchronize()
                best = max(best, 2 * n**3 / (time.perf_counter() - started))
    finally:
        torch.set_num_threads(previous)
    return best
