"""Every method trains at its defaults on the common image sizes: 16 px (the embedded digits, and a folder of
16 px images), 32 px (CIFAR-10's size), 64 px and 224 px folders.

Each cell goes the way `unison train --method M --data FOLDER` goes, on a folder of 4 tiny images: the whole
check before any worker starts (`resolve_run`, `preflight`), then the step every worker builds (`build_run`)
and one optimiser step on a batch of 2, or the smallest the method's defaults take (`SSLMethod.smallest_batch`:
W-MSE whitens one sub-batch wider than its embedding) on a folder of that many. The defaults are the recipe's,
derived from the image size and the backbone's patch size (`unison.training.resolve.resolve_recipe`): the ViT
methods' patches, the multi-crop methods' local crops, the multi-view methods' views (MMCR, EMP-SSL's patches). A
failing cell names the method and the size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unison.config import DistributedConfig, TrainConfig
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.methods import METHODS
from unison.models.vit import VIT_BACKBONES, vit_patch_size
from unison.training.preflight import preflight
from unison.training.resolve import RunPlan, resolve_recipe, resolve_run, validate_run
from unison.training.step import accumulated_forward_backward, build_run, optimizer_step, steps

SIZES = ("digits", 16, 32, 64, 224)
# The ViT the recipes' vit_tiny_auto is at each size: at least 8 x 8 patches, the largest patch that leaves them.
# The embedded digits keep their own tuned recipe (vit_nano_p4 or vit_nano_p2).
VIT_AT = {16: "vit_tiny_p2", 32: "vit_tiny_p4", 64: "vit_tiny_p8", 224: "vit_tiny"}


def _batch(method: str) -> int:
    """The cell's batch: 2, or the smallest the method's defaults take."""
    return max(2, METHODS[method].smallest_batch(METHODS[method].Params()))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """folder(size, n): a folder of max(4, n) random RGB images (2 classes) of `size` px, made once."""
    rng = np.random.default_rng(0)
    made: dict[tuple[int, int], Path] = {}

    def folder(size: int, n: int) -> Path:
        n = max(4, n)
        if (size, n) not in made:
            root = tmp_path_factory.mktemp(f"images{size}x{n}")
            for k in range(n):
                (root / f"c{k % 2}").mkdir(exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                    root / f"c{k % 2}" / f"{k}.png")
            made[size, n] = root
        return made[size, n]
    return folder


def _defaults(method: str, size: int | str, folders, out: Path) -> TrainConfig:
    """`unison train --method M --data D` with nothing else set but what makes it tiny (batch, steps, one process)
    and distill's teacher (it has none by default)."""
    batch = _batch(method)
    data = "digits" if size == "digits" else str(folders(int(size), batch))
    return TrainConfig(method=method, data=data, batch_size=batch, max_steps=1, threads=1, out=str(out),
                       subset=max(8, batch) if size == "digits" else None, val_subset=8 if size == "digits" else None,
                       random_init_knn=False, teacher="random" if method == "distill" else None,
                       distributed=DistributedConfig(backend="local", world_size=1))


def _one_step(plan: RunPlan) -> tuple[dict, list[int], float]:
    init_distributed(plan.cfg.distributed)
    try:
        run = build_run(plan, torch.device("cpu"))
        micro = next(iter(steps(run, 0)))
        loss = accumulated_forward_backward(run, micro)
        optimizer_step(run, micro[0].step)
        return run.resolved, list(run.augment.view_sizes), float(loss)
    finally:
        shutdown_distributed(None)   # one process: nothing to wait for


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_at_its_defaults(method, size, folders, tmp_path, one_torch_thread):
    cell = f"{method} at {'16 px (the embedded digits)' if size == 'digits' else f'{size} px'}"
    try:
        plan = resolve_run(_defaults(method, size, folders, tmp_path / "run"))
        preflight(plan, launched=False)
        resolved, views, loss = _one_step(plan)
    except Exception as exc:   # the cell, then what refused it
        pytest.fail(f"{cell}: its defaults do not train: {type(exc).__name__}: {exc}")
    assert np.isfinite(loss), f"{cell}: loss {loss} at the first step"
    backbone = resolved["backbone"]
    if size != "digits" and backbone in VIT_BACKBONES:   # 4 px patches at 224 px: 3,136 tokens, hours per epoch
        assert backbone == VIT_AT[int(size)], f"{cell}: the recipe's ViT is {backbone}, not {VIT_AT[int(size)]}"
    if backbone in VIT_BACKBONES:
        patch = vit_patch_size(backbone)
        assert all(v % patch == 0 for v in views), f"{cell}: views {views} with {patch} px patches of {backbone}"
    # multi-crop (smaller views after the global ones; FastSiam has 4 global, MMCR and EMP-SSL their parameter's):
    # local crops about 3/7 of the image (96 px at 224), at least 8 px
    if views[-1] != views[0]:
        assert 8 <= views[-1] <= views[0] // 2, f"{cell}: local crops of {views[-1]} px at {views[0]} px"


@pytest.mark.parametrize("backbone, size, local", [
    ("vit_small_p4", 32, 12), ("vit_small", 224, 96), ("vit_tiny_auto", 64, 24), ("vit_tiny_auto", 16, 8),
    ("small_cnn", 32, 14), ("resnet18", 64, 27), ("timm:vit_tiny_patch16_224", 32, 16)])
def test_local_crops_follow_the_backbone_a_user_gives(backbone, size, local):
    """DINO (or SwAV) on a ViT the user names: the default local crops are a multiple of its patch size (DINO-ViT
    at 32 px used to be refused: 14 px crops, 4 px patches); a CNN keeps 3/7 of the image; a size given is kept."""
    if backbone.startswith("timm:"):
        pytest.importorskip("timm")
    asked = {"local_crops": 4} if size <= 32 else {}   # at 32 px and below they train 2 views unless asked
    for method in ("dino", "swav"):
        cfg = TrainConfig(method=method, data="/data/images", backbone=backbone, **asked)
        assert resolve_recipe(cfg, size).local_crop_size == local, (method, backbone, size)
        assert resolve_recipe(cfg).local_crop_size is None   # the size unknown: the data's, at the build
    given = TrainConfig(method="dino", data="/data/images", backbone=backbone, local_crop_size=10, image_size=size)
    assert resolve_recipe(given).local_crop_size == 10
    assert resolve_recipe(TrainConfig(method="dino", local_crops=0), 224).local_crop_size is None


@pytest.mark.parametrize("method, size, crops", [
    ("swav", 32, 0), ("dino", 32, 0), ("dino", 16, 0), ("swav", 33, None), ("dino", 64, None),
    ("lejepa", 16, 0), ("lejepa", 32, None), ("ibot", 16, None), ("ibot", 32, None)])
def test_small_images_train_two_views_where_that_was_measured_better(method, size, crops):
    """At CIFAR-10's size and below SwAV and DINO train their 2 global views (better and faster there, on both
    seeds measured), LeJEPA at 16 px (measured on the digits only); above, and iBOT at every size, the
    augmentation's local crops. Asking wins."""
    from unison.training.resolve import data_spec

    cfg = TrainConfig(method=method, data="/data/images")
    recipe = resolve_recipe(cfg, size)
    assert (recipe.local_crops, data_spec(cfg, recipe).local_crops) == (crops, crops)
    assert (resolve_recipe(cfg, size).local_crop_size is None) is (crops == 0)
    for asked in ({"local_crops": 2}, {"local_crop_size": 10}):   # either one asks for local crops
        assert resolve_recipe(TrainConfig(method=method, data="/data/images", **asked), size).local_crops != 0


class _Images32:
    """The user's own dataset: 4 uint8 images of 32 px (CIFAR-10's size), no labels."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("method", ["ibot", "lejepa"])
def test_own_dataset_of_32px_images_trains_at_the_defaults(method, tmp_path, one_torch_thread):
    """Your own dataset (the API's dataset=) of 32 px images: the image size comes from the dataset's first item, and the
    recipe's local crops follow it (12 px, 4 px patches), as for a folder."""
    from unison.training.pieces import OwnPieces

    own = OwnPieces(dataset=_Images32())
    cfg = validate_run(TrainConfig(method=method, batch_size=2, max_steps=1, threads=1, out=str(tmp_path / "r"),
                                   random_init_knn=False, distributed=DistributedConfig(backend="local", world_size=1)),
                       own=own)
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"), own=own)
        micro = next(iter(steps(run, 0)))
        assert np.isfinite(float(accumulated_forward_backward(run, micro)))
    finally:
        shutdown_distributed(None)
    assert run.augment.view_sizes == [32, 32, 12, 12, 12, 12] and run.resolved["backbone"] == "vit_tiny_p4"


def test_auto_vit_patch_follows_the_image_size_and_an_odd_size_is_one_line():
    from unison.errors import ConfigError
    from unison.models.backbones import resolve_backbone

    pinned = {s: resolve_backbone("vit_small_auto", s) for s in (8, 16, 32, 64, 96, 100, 128, 224, None)}
    assert pinned == {8: "vit_small_p2", 16: "vit_small_p2", 32: "vit_small_p4", 64: "vit_small_p8",
                      96: "vit_small_p8", 100: "vit_small_p4", 128: "vit_small", 224: "vit_small",
                      None: "vit_small_p4"}
    with pytest.raises(ConfigError, match="image size 33 px is not a multiple of any ViT patch size"):
        validate_run(TrainConfig(method="mae", data="/data/images", image_size=33))
