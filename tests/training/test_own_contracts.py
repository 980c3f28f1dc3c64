"""Your own objects through the API that break their contract, in process (no worker starts): a ``__getitem__`` that
raises shows the user's frame and what unison was doing; ``__len__`` (1e12, negative, more than there are), a
backbone wider in training than in eval mode and one returning NaN are one checked line each. Then, in loader
processes and at two workers:

Your own dataset breaking its contract where unison's processes read it: a ``__getitem__`` raising in a loader
process or on rank 1 is one line with the user's frame and the item (not torch's "Caught ... in DataLoader worker
process" with its traceback); a ``__len__`` that differs between ranks is named before any collective (it was a gloo
``EnforceNotMet`` abort); an iterable yielding fewer items on one rank stops the run (it trained to exit 0)."""

from __future__ import annotations

import pytest
from helpers.faulty_pieces import Length, LengthPerRank, NaNOut, RaisesAt, ShortOnRank1, StreamRaises, WiderInTraining
from helpers.own_pieces import WIDTH, Photos

import unison
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import ConfigError, DataError, UnisonError

FRAME = "faulty_pieces.py:"   # the user's file, with the line that raised


class _LiesAboutLength(Photos):
    def __len__(self):
        return 40   # 32 items


CASES = {  # name: (pieces, error class, fragments of the one line)
    "getitem raises": (dict(dataset=RaisesAt(bad=5)), DataError,
                       ["your dataset RaisesAt raised at item 5: ValueError: cannot decode photo 5", FRAME,
                        'raise ValueError(f"cannot decode photo {i}")']),
    "iterable raises": (dict(dataset=StreamRaises()), DataError,
                        ["your dataset StreamRaises raised at item 3 of its pass: OSError: shard-0003.tar is gone", FRAME]),
    "len 1e12": (dict(dataset=Length(10**12)), ConfigError, ["dataset Length's __len__ returned 1000000000000"]),
    "len negative": (dict(dataset=Length(-3)), ConfigError, ["dataset Length's __len__ returned -3"]),
    "len more than there are": (dict(dataset=_LiesAboutLength()), DataError,
                                ["raised at item 39 (its last by __len__, which says 40 items): IndexError"]),
    "wider in training mode": (dict(backbone=WiderInTraining(), feature_dim=WIDTH), ConfigError,
                               [f"WiderInTraining in training mode returns (2, {WIDTH + 4})", "eval mode alike"]),
    "NaN features": (dict(backbone=NaNOut(), feature_dim=WIDTH), ConfigError,
                     ["backbone= NaNOut returns non-finite features (NaN or inf)"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_contract_is_one_line(case, tmp_path, monkeypatch):
    import multiprocessing.process

    def refuse(*args, **kwargs):
        raise AssertionError("a process started: the contract was not checked before the workers")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    pieces, error, fragments = CASES[case]
    config = TrainConfig(method="simclr", batch_size=8, max_steps=1, out=str(tmp_path / "run"), progress=False,
                         distributed=DistributedConfig(world_size=1))
    with pytest.raises(UnisonError) as caught:
        unison.train(config, **pieces)
    message = str(caught.value)
    assert isinstance(caught.value, error) and "\n" not in message, message
    assert all(f in message for f in fragments), message


# -- with real processes --


RUN_CASES = {  # name: (dataset, world size, loader processes, fragments of the one line)
    "raises in a loader process": (RaisesAt(where="loader"), 1, 1,
                                   ["your dataset RaisesAt raised at item", "ValueError: cannot decode photo", FRAME]),
    "raises on rank 1": (RaisesAt(where="rank1"), 2, 1,
                         ["rank 1", "your dataset RaisesAt raised at item", "ValueError: cannot decode photo", FRAME]),
    "len differs between ranks": (LengthPerRank(), 2, 0,
                                  ["your dataset LengthPerRank has 32 items on rank 0 and 48 on rank 1"]),
    "iterable shorter on rank 1": (ShortOnRank1(), 2, 0,
                                   ["your dataset ShortOnRank1 yields different items on different ranks",
                                    "rank 0 is at item 16 of pass 0, rank 1 at item 0 of pass 1"]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", RUN_CASES)
def test_a_dataset_breaking_its_contract_in_the_workers_is_one_line(case, tmp_path):
    dataset, world, loader_workers, fragments = RUN_CASES[case]
    config = TrainConfig(method="simclr", batch_size=16, max_steps=4, signal_images=0, progress=False, threads=1,
                         out=str(tmp_path / "run"), loader_workers=loader_workers,
                         distributed=DistributedConfig(world_size=world))
    with pytest.raises(UnisonError) as caught:
        unison.train(config, dataset=dataset)
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert "Original Traceback" not in message and "SIGABRT" not in message
