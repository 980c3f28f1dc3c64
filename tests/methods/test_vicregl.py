"""VICRegL, the method (one process): the cells' locations from the views' crops, its heads for each alpha, its
backbones and views, the keys it needs; and that the training step hands it the crops of the views it trains on."""

from __future__ import annotations

import pytest
import torch

from unison.data.augment import ViewAugmenter
from unison.methods import SampleKeys, VICRegL, VICRegLParams
from unison.methods.vicregl import cell_locations
from unison.models import build_backbone
from unison.models.dense import coarse_grid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(proj_hidden_dim=16, proj_dim=8, maps_hidden_dim=8, maps_dim=4)


def _batch(preset: str = "digits", n: int = 6, size: int = 16):
    aug = ViewAugmenter(preset, size, (0.5,) * 3, (0.25,) * 3)
    images = torch.randint(0, 256, (n, 3, 20, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    idx = torch.arange(10, 10 + n)
    views = aug(images, idx, epoch=1, seed=2)
    return views, SampleKeys(2, 1, idx, aug.view_geometry(idx, 1, 2, torch.tensor([[20, 28]]).expand(n, 2)))


def _model(backbone: str = "small_cnn", size: int = 16, **params) -> VICRegL:
    torch.manual_seed(0)
    net, dim = build_backbone(backbone, size)
    return VICRegL(net, dim, VICRegLParams(**{**SMALL, **params}))


def test_cell_locations_follow_the_crop_box_and_its_flip():
    """A view that is the right half of a 20 x 40 image, and the same view flipped: cell (row 0, column 0) lies
    near the image's centre top, and flipped near its right edge."""
    box = torch.tensor([[[10.0, 0.0, 30.0], [0.0, 10.0, 10.0]]], dtype=torch.float64)   # x: 20..40, y: 0..20
    flipped = box.clone()
    flipped[:, 0, 0] *= -1
    _, centres = coarse_grid(torch.zeros(1, 2, 2, 1), 0)            # 2 x 2 cells at +-0.5
    here, there = cell_locations(box, centres)[0], cell_locations(flipped, centres)[0]
    assert here.tolist() == [[25.0, 5.0], [35.0, 5.0], [25.0, 15.0], [35.0, 15.0]]
    assert there.tolist() == [[35.0, 5.0], [25.0, 5.0], [35.0, 15.0], [25.0, 15.0]]


@pytest.mark.parametrize("backbone", ["small_cnn", "vit_micro_auto"])
def test_vicregl_trains_on_any_backbone_with_a_feature_map(backbone):
    model = _model(backbone)
    views, keys = _batch()
    for _ in range(2):   # plain SGD steps (torch.optim's first use imports torch._dynamo: seconds)
        loss = model(views, keys=keys)
        assert torch.isfinite(loss)
        model.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    model.eval()
    assert model.embed(views[0]).shape == (6, model.feature_dim)


def test_vicregl_takes_local_crops():
    views, keys = _batch("multicrop")
    assert len(views) == 6 and views[2].shape[-1] < views[0].shape[-1]
    assert torch.isfinite(_model()(views, keys=keys))


def test_each_alpha_builds_only_the_heads_its_criteria_use():
    views, keys = _batch()
    only_global, only_local, both = _model(alpha=1.0), _model(alpha=0.0), _model()
    assert only_global.maps_projector is None and only_local.projector is None
    assert both.projector is not None and both.maps_projector is not None
    for model in (only_global, only_local):
        model(views, keys=keys).backward()
        assert all(p.grad is not None for p in model.parameters())   # DDP refuses parameters without a gradient


def test_large_feature_maps_are_pooled_to_the_grid_size():
    views, keys = _batch(size=32)                    # the small CNN's map: 8 x 8 cells
    seen = []
    model = _model(size=32, grid_size=3)
    model.maps_projector.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(views, keys=keys)
    assert seen[0][0] == 6 * 3 * 3
    seen.clear()
    model = _model(size=32, grid_size=0)
    model.maps_projector.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(views, keys=keys)
    assert seen[0][0] == 6 * 8 * 8


def test_vicregl_needs_the_crops_of_its_views():
    views, keys = _batch()
    model = _model()
    with pytest.raises(ValueError, match="needs keys=SampleKeys"):
        model(views)
    with pytest.raises(ValueError, match="needs keys=SampleKeys"):
        model(views, keys=SampleKeys(keys.seed, keys.epoch, keys.indices))
    with pytest.raises(ValueError, match="crops of shape"):
        model(views, keys=SampleKeys(keys.seed, keys.epoch, keys.indices, keys.crops[:, :1]))
    assert VICRegL.needs_sample_keys and VICRegL.needs_crop_geometry


def test_the_training_step_hands_vicregl_the_crops_of_its_views(tmp_path, monkeypatch):
    """`unison.training.step` builds the keys from the batch source that cut the views (the embedded digits in
    memory): the crops the method receives are those of the views' own samples, epoch and seed."""
    from unison.config import DistributedConfig, TrainConfig
    from unison.distributed.env import init_distributed, shutdown_distributed
    from unison.training.step import accumulated_forward_backward, build_run, steps

    cfg = TrainConfig(method="vicregl", data="digits", batch_size=4, max_steps=1, threads=1, out=str(tmp_path),
                      subset=8, val_subset=8, random_init_knn=False, knn=False, seed=3,
                      method_params={k: v for k, v in SMALL.items()},
                      distributed=DistributedConfig(backend="local", world_size=1))
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"))
        received = []
        forward = run.method.forward
        monkeypatch.setattr(run.method, "forward", lambda views, keys: received.append(keys) or forward(views, keys))
        micro = next(iter(steps(run, 0)))
        accumulated_forward_backward(run, micro)
    finally:
        shutdown_distributed(None)
    keys, images = received[0], run.train_set.images
    size = torch.tensor(images.shape[-2:]).expand(len(micro[0].indices), 2)
    expected = run.augment.view_geometry(micro[0].indices, micro[0].epoch, 3, size)
    assert keys.crops is not None and torch.equal(keys.crops, expected) and torch.equal(keys.indices, micro[0].indices)
