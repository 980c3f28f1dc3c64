"""Your own dataset breaking its contract where unison's processes read it: a ``__getitem__`` raising in a loader
process or on rank 1 is one line with the user's frame and the item (not torch's "Caught ... in DataLoader worker
process" with its traceback); a ``__len__`` that differs between ranks is named before any collective (it was a gloo
``EnforceNotMet`` abort); an iterable yielding fewer items on one rank stops the run (it trained to exit 0)."""

from __future__ import annotations

import pytest
from helpers.faulty_pieces import LengthPerRank, RaisesAt, ShortOnRank1

import unison
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.errors import UnisonError

FRAME = "faulty_pieces.py:"

CASES = {  # name: (dataset, world size, loader processes, fragments of the one line)
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


@pytest.mark.parametrize("case", CASES)
def test_a_dataset_breaking_its_contract_in_the_workers_is_one_line(case, tmp_path):
    dataset, world, loader_workers, fragments = CASES[case]
    config = TrainConfig(method="simclr", batch_size=16, max_steps=4, signal_images=0, progress=False, threads=1,
                         out=str(tmp_path / "run"), loader_workers=loader_workers,
                         distributed=DistributedConfig(world_size=world))
    with pytest.raises(UnisonError) as caught:
        unison.train(config, dataset=dataset)
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert "Original Traceback" not in message and "SIGABRT" not in message
