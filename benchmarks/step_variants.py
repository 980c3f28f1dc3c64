"""The speed-run step and its variants, side by side in one process: what each setting costs or buys on a device.

    python3 benchmarks/step_variants.py --device cuda          # ResNet-18, batch 512, bf16: the GPU preset
    python3 benchmarks/step_variants.py --device cpu --tiny    # the dry run: small CNN, batch 16, a few steps

Each variant builds the training step that ``unison train --preset speedrun`` runs (`unison.training.step.
build_run`: synthetic 32 px images resident on the device, the device-side views, forward, backward, optimiser)
and times `steps` steps after `warmup` untimed ones, the device synchronised at both ends. The variants:

* ``preset``: as the preset trains (cuDNN times its algorithms: `torch.backends.cudnn.benchmark`);
* ``cudnn default``: cuDNN's own choice, untimed (torch's default, and a ``--deterministic`` run's);
* ``fixed views``: one batch of views made once and trained on at every step: the step without its augmentation;
* ``batch 2x``: twice the batch, for images/s (the schedule a larger batch needs is another question);
* ``batch 0.5x``: half the batch: what images/s a smaller batch gives up (on the CPU's 100-epoch proxy, half the
  batch scored higher at equal epochs: docs/benchmarks.md, "Many epochs").

Report ratios against ``preset``, which all come from one process, one variant after the other; absolute times
only from a GPU. `benchmarks/gpu_proof.py` runs this as its ``step`` phase.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("preset", "cudnn default", "fixed views", "batch 2x", "batch 0.5x")
BATCH_FACTOR = {"batch 2x": 2.0, "batch 0.5x": 0.5}


def variant_config(device: str, tiny: bool, batch_factor: float = 1.0) -> Any:
    """The speed-run preset's training configuration on `device`, on synthetic resident images."""
    from unison.config import TrainConfig

    batch = round((16 if tiny else 512) * batch_factor)
    given = {"preset": "speedrun", "data": "synthetic", "batch_size": batch, "epochs": 1000, "image_size": 32,
             "progress": False, "online_probe": False, "knn": False, "compile": False,
             "distributed": {"backend": "local", "world_size": 1}}
    if tiny:
        given["backbone"] = "small_cnn"
    return TrainConfig.from_dict(given, cuda_available=device == "cuda")


def time_variant(name: str, device_name: str, tiny: bool, warmup: int, steps: int) -> dict[str, Any]:
    """ms per step and images/s of variant `name` (`VARIANTS`); the process group is initialised."""
    import torch

    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import batches, build_run

    device = torch.device(device_name)
    cfg = variant_config(device_name, tiny, BATCH_FACTOR.get(name, 1.0))
    run = build_run(cfg, device, train_set=synthetic_dataset(4 * cfg.batch_size, 32).to(device))
    torch.backends.cudnn.benchmark = name != "cudnn default"   # after the build, which sets the run's own
    stream = batches(run)
    fixed = next(stream) if name == "fixed views" else None
    seconds = _timed(run, stream, fixed, warmup, steps)
    row = {"variant": name, "batch": cfg.batch_size, "amp": cfg.amp, "backbone": run.cfg.backbone,
           "ms_per_step": 1000 * seconds / steps, "images_per_s": steps * cfg.batch_size / seconds}
    del run, stream, fixed
    gc.collect()
    if device.type == "cuda":
        row["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return row


def _timed(run: Any, stream: Any, fixed: Any, warmup: int, steps: int) -> float:
    """Seconds of `steps` steps after `warmup` untimed ones; `fixed`: the one batch every step trains on."""
    import torch

    from unison.training.step import forward_backward, optimizer_step

    def sync() -> None:
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)

    for n in range(warmup + steps):
        if n == warmup:
            sync()
            started = time.perf_counter()
        forward_backward(run, fixed if fixed is not None else next(stream))
        optimizer_step(run, n)
    sync()
    return time.perf_counter() - started


def measure(device: str, tiny: bool, on_row: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every variant, one after the other in this process; each row's images/s against the preset's. `on_row`
    gets the result so far after each variant (the GPU proof keeps it, in case its time box ends the rest)."""
    from unison.distributed.testing import run_in_workers

    warmup, steps = (1, 2) if tiny else (15, 60)
    result: dict[str, Any] = {"warmup_steps": warmup, "timed_steps": steps, "variants": []}
    rows = result["variants"]
    for name in VARIANTS:
        try:
            rows.append(run_in_workers(time_variant, 1, args=(name, device, tiny, warmup, steps), backend="local")[0])
        except Exception as e:   # one variant failing must not lose the others
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        base = rows[0].get("images_per_s")
        if base and rows[-1].get("images_per_s"):
            rows[-1]["vs_preset"] = rows[-1]["images_per_s"] / base
        on_row(result)
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    lines = [f"The speed-run step ({result['timed_steps']} steps timed after {result['warmup_steps']}), one variant "
             "after the other in one process:", "",
             "| variant | batch | ms / step | images/s | vs preset | peak MiB |", "|---|---|---|---|---|---|"]
    for r in result["variants"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | | not measured: {r['error']} | | | |")
            continue
        peak = f"{r['peak_memory_mib']:.0f}" if "peak_memory_mib" in r else "n/a"
        lines.append(f"| {r['variant']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                     f"{r.get('vs_preset', 0):.2f}x | {peak} |")
    return lines


if __name__ == "__main__":   # the launcher's fork server imports this file: run only as a script
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    result = measure(args.device, args.tiny)
    print("\n".join(markdown(result)))
    print(json.dumps(result, indent=1))
