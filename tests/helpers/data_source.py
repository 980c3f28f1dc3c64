"""Helpers shared by the unit and distributed tests of test_data_source."""

from __future__ import annotations

import pytest

from unison.data.generated import write_image_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("source")
    write_image_folder(tmp / "train", 48, classes=2, sizes=(16, 40), seed=1)
    write_image_folder(tmp / "val", 12, classes=2, sizes=(16, 40), seed=2)
    write_image_folder(tmp / "square", 24, classes=2, sizes=(20, 20), seed=3)
    flat = tmp / "flat"
    flat.mkdir()
    for p in sorted((tmp / "train").rglob("*.*")):
        (flat / p.name).write_bytes(p.read_bytes())
    return {"train": str(tmp / "train"), "val": str(tmp / "val"), "flat": str(flat), "square": str(tmp / "square")}
