"""What only a CUDA device can show (marker ``gpu``; `benchmarks/gpu_proof.sh` runs ``pytest -m gpu`` on a lent GPU):
SyncBN, bf16 autocast, channels_last, ``--compile`` and nvJPEG on CUDA, ``unison check`` on CUDA (2 ranks sharing
GPU 0 over gloo, float64: DDP and ``--shard full``), and whether NCCL takes two ranks on one GPU.

On a machine without CUDA the whole module is one skipped line.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests run on a lent GPU (benchmarks/gpu_proof.sh)", allow_module_level=True)

from unison.config import TrainConfig  # noqa: E402
from unison.config.distributed import DistributedConfig  # noqa: E402
from unison.data.synthetic import synthetic_dataset  # noqa: E402
from unison.distributed.testing import run_in_workers  # noqa: E402
from unison.equivalence.steps import run_equivalence  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _one_step(cfg_kwargs: dict, backbone: str = "resnet18") -> dict:
    """Two steps of `unison train`'s step on GPU 0 (world size 1): the first conv's output dtype, the layout of
    the first conv weight, the losses."""
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    cfg = TrainConfig(method="simclr", data="synthetic", backbone=backbone, batch_size=32, epochs=1,
                      image_size=32, progress=False, online_probe=False,
                      distributed=DistributedConfig(backend="local", world_size=1), **cfg_kwargs)
    run = build_run(cfg, CUDA, train_set=synthetic_dataset(64, 32).to(CUDA))
    conv = next(m for m in run.method.modules() if isinstance(m, torch.nn.Conv2d))
    seen: dict = {}

    def record_dtype(module, inputs, output) -> None:   # a hook that returns a value replaces the output
        seen.setdefault("dtype", output.dtype)

    conv.register_forward_hook(record_dtype)
    losses = []
    for batch in batches(run):
        losses.append(float(forward_backward(run, batch)))
        optimizer_step(run, batch.step)
    channels_last = conv.weight.is_contiguous(memory_format=torch.channels_last)
    return {"dtype": seen["dtype"], "channels_last": channels_last, "losses": losses}


def _local(fn, *args):
    return run_in_workers(fn, 1, args=args, backend="local")[0]


def test_bf16_autocast_runs_the_convolutions_in_bf16():
    out = _local(_one_step, {"amp": "bf16"})
    assert out["dtype"] == torch.bfloat16 and all(np.isfinite(out["losses"]))


def test_channels_last_weights_on_cuda():
    assert _local(_one_step, {"channels_last": True})["channels_last"]
    assert not _local(_one_step, {"channels_last": False})["channels_last"]


def test_compile_matches_eager_on_the_first_step():   # small_cnn: compiling ResNet-18 takes most of a minute
    eager, compiled = _local(_one_step, {}, "small_cnn"), _local(_one_step, {"compile": True}, "small_cnn")
    assert abs(compiled["losses"][0] - eager["losses"][0]) <= 1e-3 * abs(eager["losses"][0])


def test_nvjpeg_decode_matches_the_cpu_decode():
    import simplejpeg
    from PIL import Image
    from torchvision.io import decode_jpeg

    from unison.data.gpu_decode import GpuCropper
    from unison.data.memory import decode_bytes

    rng = np.random.default_rng(0)
    images = []
    for _ in range(4):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).resize((128, 96)).save(buf, "JPEG")
        images.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    cropper = GpuCropper(None, seed=0, device=CUDA)   # type: ignore[arg-type]   # decode needs no augmenter
    decoded = cropper.decode(images)
    assert decode_jpeg is not None and all(d.device.type == "cuda" and d.shape == (3, 96, 128) for d in decoded)
    # nvJPEG upsamples the half-resolution colour planes as libjpeg's fast path does, not as its default (fancy)
    # one: on this colour noise the two libjpeg paths differ by 19 levels on average (measured on an H100 run,
    # reproduced on the CPU), so the reference is libjpeg's fast path; the IDCTs differ by a few levels at most
    for d, data in zip(decoded, images):
        fast = torch.from_numpy(simplejpeg.decode_jpeg(data.numpy().tobytes(), fastupsample=True)).permute(2, 0, 1)
        assert float((d.cpu().int() - fast.int()).abs().float().mean()) < 3.0
        assert decode_bytes(data.numpy().tobytes()).shape == fast.shape


@pytest.mark.parametrize("shard", ["none", "optimizer"])   # full: refused on gloo + CUDA (killed both ranks)
def test_unison_check_on_cuda_two_ranks_one_gpu_gloo_float64(shard):
    # SyncBN in both: without it the ranks' BatchNorm statistics differ from the global batch's (the optimizer
    # case failed on an H100 for that alone, and fails the same on a CPU)
    report = run_equivalence("simclr", 2, device="cuda", dtype="float64", shard=shard, steps=2, local_batch=8,
                             sync_batchnorm=True)
    assert report.passed, report.summary()


def _nccl_all_reduce() -> float:
    from unison.distributed import collectives as C

    x = torch.ones(4, device=CUDA) * (C.rank() + 1)
    torch.distributed.all_reduce(x)
    return float(x[0])


def test_nccl_two_ranks_on_one_gpu_is_tried():
    """NCCL is expected to refuse two ranks on one GPU ("Duplicate GPU detected"); the outcome is the report."""
    try:
        result = run_in_workers(_nccl_all_reduce, 2, backend="nccl", timeout_s=60)
    except Exception as e:
        pytest.xfail(f"NCCL refused 2 ranks on 1 GPU: {type(e).__name__}: {' '.join(str(e).split())[:250]}")
    assert result == [3.0, 3.0]


def _speedrun_like(**cfg_kwargs) -> TrainConfig:
    return TrainConfig(method="simclr", data="synthetic", backbone="resnet18", batch_size=64, epochs=4,
                       image_size=32, progress=False, online_probe=False, amp="bf16", data_mode="memory",
                       distributed=DistributedConfig(backend="local", world_size=1), **cfg_kwargs)


def _device_syncs_per_step(cfg: TrainConfig, steps: int = 3) -> dict:
    """The host synchronisations CUDA itself reports (``torch.cuda.set_sync_debug_mode``) in the loop's own step
    on GPU 0: the in-memory batches and their device-side views, forward, backward and optimiser step, counted
    over `steps` steps after a first one (which creates the optimiser's state)."""
    import traceback
    import warnings
    from pathlib import Path

    from unison.training.step import build_run, forward_backward, optimizer_step
    from unison.training.step import steps as step_groups

    # 2 steps an epoch: counted steps 1-3 hold an epoch's start, whose index copy (batches.py) must not sync
    run = build_run(cfg, CUDA, train_set=synthetic_dataset(128, 32).to(CUDA))
    seen: list[str] = []

    def where(message, category, filename, lineno, file=None, line=None) -> None:   # warnings.showwarning
        if n and "synchroniz" in str(message):   # the frames that made the sync (step 0 not counted)
            frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename][-6:]
            seen.append(f"step {n}: " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} ({f.name})"
                                                    for f in reversed(frames)))

    stream = step_groups(run)
    for n in range(1 + steps):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = where
            torch.cuda.set_sync_debug_mode("warn" if n else "default")
            try:
                for batch in next(stream):
                    forward_backward(run, batch)
                optimizer_step(run, n)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return {"per_step": len(seen) / steps, "where": seen}


def test_the_step_synchronises_the_host_only_where_unison_plan_says():
    """The speed-run's claim on real CUDA: in-memory batches and device-side views cost no host sync, and the
    step makes exactly the ones `unison plan` lists (the finite-loss check)."""
    from unison.plan import step_host_syncs

    cfg = _speedrun_like()
    planned = [str(s) for s in step_host_syncs(cfg) if not s.host_only]
    out = _local(_device_syncs_per_step, cfg)
    assert out["per_step"] <= len(planned), (
        f"{out['per_step']} syncs per step, unison plan lists {len(planned)}: {planned}; seen at {out['where']}")
