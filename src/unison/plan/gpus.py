"""GPUs `unison plan` can simulate: memory, dense bf16 peak and interconnect bandwidth, each with its source.

Peaks are NVIDIA's dense (no sparsity) bf16 tensor-core figures, the ones `unison.bench.flops` uses; bandwidth is
the per-GPU figure of the interconnect named (NVLink for SXM parts, PCIe 4.0/5.0 x16 otherwise): what a
collective among GPUs of one node can reach at best. ``--gpu 24`` (a number) is a GPU of that many GiB with
the H100's peak and bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float          # usable device memory as torch reports it (the marketed GB, in GiB)
    bf16_tflops: float         # dense bf16 tensor-core peak
    interconnect_gb_s: float   # per-GPU, one direction, GB/s (1e9 bytes)
    interconnect: str


GPUS: dict[str, GPU] = {
    # H100 SXM5 80 GB: 989.4 dense bf16 TFLOP/s, NVLink 4 900 GB/s total (450 per direction): H100 datasheet
    "h100": GPU("H100 SXM 80GB", 79.1, 989.4, 450.0, "NVLink 4"),
    # H100 PCIe 80 GB: 756 TFLOP/s, PCIe 5.0 x16 64 GB/s per direction: H100 datasheet
    "h100-pcie": GPU("H100 PCIe 80GB", 79.1, 756.0, 64.0, "PCIe 5.0 x16"),
    # H200 SXM 141 GB: H100 compute (989.4), NVLink 4: H200 datasheet
    "h200": GPU("H200 SXM 141GB", 131.3, 989.4, 450.0, "NVLink 4"),
    # A100 SXM 80/40 GB: 312 TFLOP/s, NVLink 3 600 GB/s total (300 per direction): A100 datasheet
    "a100-80": GPU("A100 SXM 80GB", 79.2, 312.0, 300.0, "NVLink 3"),
    "a100-40": GPU("A100 SXM 40GB", 39.4, 312.0, 300.0, "NVLink 3"),
    # L40S 48 GB: 362 TFLOP/s, PCIe 4.0 x16 32 GB/s: L40S datasheet
    "l40s": GPU("L40S 48GB", 44.4, 362.0, 32.0, "PCIe 4.0 x16"),
    # L4 24 GB: 121 TFLOP/s, PCIe 4.0 x16: L4 datasheet
    "l4": GPU("L4 24GB", 22.0, 121.0, 32.0, "PCIe 4.0 x16"),
    # RTX 4090 24 GB: 165.2 dense bf16 TFLOP/s (fp32 accumulate), PCIe 4.0 x16, no NVLink: Ada whitepaper
    "4090": GPU("RTX 4090 24GB", 23.6, 165.2, 32.0, "PCIe 4.0 x16"),
}
ALIASES = {"h100-80": "h100", "h100-sxm": "h100", "a100": "a100-80", "rtx4090": "4090", "h200-141": "h200"}
MIN_GIB = 1.0      # below it no GPU runs a training step: the CUDA context alone takes hundreds of MiB
MAX_GIB = 4096.0


def resolve_gpu(spec: str) -> GPU:
    """``--gpu``: a name of `GPUS` (or an alias), or a memory size in GiB (with the H100's speed)."""
    key = spec.strip().lower()
    key = ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    try:
        gib = float(key.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        names = ", ".join(sorted(GPUS))
        raise ConfigError(f"--gpu {spec!r} is unknown; use one of {names}, or a memory size in GiB (e.g. 24)") from None
    if not MIN_GIB <= gib <= MAX_GIB:   # nan too
        raise ConfigError(f"--gpu {spec!r}: {gib:g} GiB is no GPU's memory; the memory must be in [{MIN_GIB:g}, "
                          f"{MAX_GIB:g}] GiB (a number is GiB, e.g. --gpu 24), or name a GPU: {', '.join(sorted(GPUS))}")
    h100 = GPUS["h100"]
    return GPU(f"{gib:g} GiB GPU (H100 speed)", gib, h100.bf16_tflops, h100.interconnect_gb_s, h100.interconnect)
