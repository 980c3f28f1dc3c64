"""What holds across ``--data-mode memory`` and ``stream`` on the same images (README, "Across data modes"): the
same samples in the same batches, the same crop boxes, flips and colour draws, statistics of the same images;
not the same pixels (the crop is resampled differently), so losses agree closely but not bit for bit."""

from __future__ import annotations

import pytest
import torch

from unison.data.generated import write_image_folder
from unison.data.source import build_batch_source
from unison.data.spec import DataSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batches(folder: str, mode: str, count: int):
    data = build_batch_source(DataSpec(data=folder, batch_size=16, data_mode=mode, loader_workers=0, image_size=16),
                              torch.device("cpu"), "simclr")
    assert data.mode == mode
    it = data.source.iter_from(0)
    return data, [next(it) for _ in range(count)]


def _correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.flatten(1) - a.flatten(1).mean(1, keepdim=True), b.flatten(1) - b.flatten(1).mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def test_memory_and_stream_read_the_same_samples_with_the_same_draws(tmp_path):
    write_image_folder(tmp_path / "photos", 48, classes=2, sizes=(24, 24), seed=1)
    memory, in_memory = _batches(str(tmp_path / "photos"), "memory", 6)   # two epochs of 3 batches
    stream, streamed = _batches(str(tmp_path / "photos"), "stream", 6)
    assert memory.image_size == stream.image_size == 16
    assert torch.allclose(torch.tensor(memory.mean), torch.tensor(stream.mean), atol=0.01)   # the same images'
    for (e1, i1, v1), (e2, i2, v2) in zip(in_memory, streamed):
        assert e1 == e2 and torch.equal(i1, i2)   # the same samples, batch by batch, epoch after epoch
        assert [v.shape for v in v1] == [v.shape for v in v2]
        for a, b in zip(v1, v2):   # the same crop, flip and colours: each view close to its counterpart only
            assert _correlation(a, b).min() > 0.9
            assert _correlation(a, b.roll(1, 0)).abs().max() < 0.8
        assert not all(torch.equal(a, b) for a, b in zip(v1, v2))   # not bit for bit: resampled differently
