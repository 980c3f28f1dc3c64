"""End to end: `unison train` with real worker processes, its outputs, and resume across world sizes."""

import json
import re

import pytest
import torch
from fault_helpers import QUIET

from unison.cli import main
from unison.training.checkpoint import load_checkpoint

SMALL = ["--batch-size", "64", "--epochs", "1", "--no-progress", "--knn-k", "20"]


def test_main_job_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--max-steps", "4", "--out", str(out)]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert f"{summary['knn_top1']:.4f}" in last_line and f"{summary['random_init_knn_top1']:.4f}" in last_line
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert 0.0 <= summary["knn_top1"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["distributed"]["world_size"] == 2 and config["method"] == "simclr"
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert header == "step,epoch,loss,lr,images_per_s,knn_top1,data_wait,rankme,emb_std,align,uniform,probe_top1,world_size"
    ckpt = load_checkpoint(out, expect_method="simclr")
    assert ckpt["step"] == 4


@pytest.mark.slow
def test_checkpoint_at_world_size_2_resumes_at_world_size_1(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*SMALL, "--max-steps", "6", "--warmup-epochs", "0", "--precision", "float64", "--subset", "512",
              "--val-subset", "64", *QUIET]
    assert main(["train", *common, "--checkpoint-every", "3", "--out", str(a)]) == 0
    mid = a / "checkpoints" / "step_00000003.pt"
    assert main(["train", "--resume", str(mid), "--world-size", "1", "--out", str(b), "--no-progress"]) == 0
    full = load_checkpoint(a)["model"]
    resumed = load_checkpoint(b)["model"]
    assert load_checkpoint(b)["step"] == 6
    start = load_checkpoint(mid)["model"]
    moved = max(float((full[k].double() - start[k].double()).abs().max()) for k in full if full[k].is_floating_point())
    assert moved > 1e-3, "training did not change the parameters; the comparison would be vacuous"
    # float64: W=2 and W=1 differ only by summation order
    for k, v in full.items():
        if v.is_floating_point():
            scale = max(float(v.abs().max()), 1e-6)
            assert float((resumed[k] - v).abs().max()) / scale < 1e-9, k
        else:
            assert torch.equal(resumed[k], v), k


def test_unison_train_and_check_stay_callable_after_their_packages_are_imported(tmp_path):
    """`unison.train(cfg)` is the API even once the training package is imported (it is named ``training``)."""
    import unison
    import unison.equivalence.steps  # noqa: F401
    import unison.training.trainer  # noqa: F401
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig

    cfg = TrainConfig(max_steps=2, batch_size=64, subset=256, val_subset=64, knn_k=5, progress=False,
                      out=str(tmp_path / "run"), distributed=DistributedConfig(world_size=1))
    first = unison.train(cfg)
    second = unison.train(cfg)
    assert first.steps == second.steps == 2 and first.knn_top1 == second.knn_top1
    assert callable(unison.check) and callable(unison.evaluate)
    assert re.search(r", 2 steps, \d+ s training: kNN top-1 0\.\d{4}", first.result_line())   # the library's line


@pytest.fixture(scope="module")
def with_a_corrupt_image(tmp_path_factory):
    """63 readable 16 px images in 2 classes and one file that is not an image: 64, 4 batches of 16 an epoch."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("corrupt") / "train"
    rng = np.random.default_rng(0)
    for i in range(63):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / f"c{i % 2}" / f"{i:02d}.png")
    (root / "c0" / "bad.png").write_bytes(b"not an image")
    return root


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_skipped_image_is_reported_once_over_the_workers_in_the_log_and_the_summary(with_a_corrupt_image, tmp_path,
                                                                                      capfd, mode, monkeypatch):
    """2 workers: in memory each decodes every image (each met the bad file), streamed each its slices of the
    batches. Before, each worker warned on its own (twice at W=2), and neither train.log nor summary.json said so."""
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    out = tmp_path / "run"
    argv = ["train", "--data", str(with_a_corrupt_image), "--data-mode", mode, "--batch-size", "16", "--epochs", "2",
            "--world-size", "2", "--no-progress", "--no-knn", "--no-online-probe", "--logger", "none", *QUIET,
            "--out", str(out)]
    capfd.readouterr()
    assert main(argv) == 0
    err = capfd.readouterr().err
    bad = str(with_a_corrupt_image / "c0" / "bad.png")
    assert err.count(f"skipped unreadable training image {bad}") == 1 and err.count(bad) == 2, err
    total = f"1 unreadable training image skipped in this run (--on-corrupt skip, over 2 workers): {bad}"
    assert total in err and total in (out / "train.log").read_text()
    assert json.loads((out / "summary.json").read_text())["unreadable_images"] == 1
