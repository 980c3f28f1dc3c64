"""Hostile and careless data sources (issue "Nothing lost"): each ends in one `DataError` line, fast.

Every case is built in ``tmp_path`` (FIFOs, links to /dev/zero, link loops) and checked in this process
through `open_checked` (what the pre-flight and every worker's build call), `open_catalog` or the
decode paths. A case that hung on the old code runs under `_within` (a thread with a time limit), so it
fails instead of hanging the suite.
"""

from __future__ import annotations

import io
import os
import struct
import tarfile
import threading
import time
import zlib
from pathlib import Path

import pytest

from unison.data import files
from unison.data.catalog import open_catalog
from unison.data.source import open_checked
from unison.data.spec import DataSpec
from unison.errors import DataError


def _png(path: Path, value: int = 0, size: int = 8) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (value, 255 - value, value // 2)).save(path)


def _folder(root: Path, per_class: int = 8) -> Path:
    for c in ("a", "b"):
        for i in range(per_class):
            _png(root / c / f"{i:03d}.png", 20 * i)
    return root


def _tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return str(path)


def _within(seconds: float, fn):
    """fn() in a thread; its result or exception, or a test failure when it has not ended in `seconds`."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (a hang)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _refused(fragment: str, fn, seconds: float = 20) -> str:
    with pytest.raises(DataError) as info:
        _within(seconds, fn)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    return message


# ------------------------------------------------------------------ folders
@pytest.mark.parametrize("extra", ["thumbs/x.png", "zz.png/x.png"], ids=["subfolder", "folder-named-png"])
def test_flat_folder_with_a_subfolder_is_refused_by_name(tmp_path, extra):
    for i in range(4):
        _png(tmp_path / "d" / f"{i}.png", i)
    _png(tmp_path / "d" / extra, 9)
    folder = extra.split("/")[0]
    msg = _refused("holds both images (0.png, 1.png, 2.png and 1 more)", lambda: open_catalog(str(tmp_path / "d")))
    assert f"subfolders ({folder})" in msg and "give a file list" in msg


@pytest.mark.parametrize("splits, role, instead", [
    (("train", "val"), "--data", "give --data {d}/train --val {d}/val"),
    (("test", "train"), "--data", "give --data {d}/train --val {d}/test"),
    (("Training", "Validation"), "--data", "give --data {d}/Training --val {d}/Validation"),
    (("train",), "--data", "give --data {d}/train"),
    (("val",), "--data", "give --data the training split's folder and --val {d}/val"),
    (("train", "val"), "--val", "give --val {d}/val"),
], ids=["train-val", "train-test", "capitalised", "train-only", "val-only", "as-val"])
def test_the_parent_of_the_splits_is_refused_naming_the_folders_to_give(tmp_path, splits, role, instead):
    """`--data cifar10` (holding train/ and val/) trained a 2-class "train"/"val" set, the held-out images inside
    the training data. Class folders all named like splits are refused before the tree is read."""
    for split in splits:
        for c in ("cat", "dog"):
            _png(tmp_path / "d" / split / c / "0.png")
    d = str(tmp_path / "d")
    shown = " and ".join(f"{s}/" for s in splits)
    message = _refused(f"{role} {d} holds the splits {shown}, not class folders: ", lambda: open_catalog(d, role))
    assert message.endswith(instead.format(d=d)), message


def test_a_class_named_like_a_split_among_others_is_warned_of(tmp_path):
    for c in ("cat", "dog", "test"):
        _png(tmp_path / "d" / c / "0.png")
    with pytest.warns(UserWarning, match=r"class folder\(s\) named like data splits \(test/\) beside 2 other"):
        catalog = open_catalog(str(tmp_path / "d"), "--data")
    assert catalog.classes == ["cat", "dog", "test"]


def test_symlink_loop_counts_each_image_once(tmp_path):
    root = _folder(tmp_path / "d")
    os.symlink("..", root / "a" / "up")                 # a loop back to the data folder
    os.symlink("../b", root / "a" / "also_b")           # another class, counted there
    outside = tmp_path / "extra"
    _png(outside / "e.png", 3)
    os.symlink(outside, root / "b" / "linked")          # a folder outside the data: followed, once
    os.symlink(outside, root / "b" / "linked_again")
    cat = _within(20, lambda: open_catalog(str(root)))
    assert len(cat) == 17 and sorted(cat.classes) == ["a", "b"]
    assert int((cat.labels == 0).sum()) == 8 and int((cat.labels == 1).sum()) == 9


@pytest.mark.parametrize("role", ["data", "val"])
def test_empty_data_path_is_refused_not_read_as_the_current_folder(role):
    spec = DataSpec(data="", batch_size=1) if role == "data" else DataSpec(val="")
    _refused(f"--{role} '' is not a path", lambda: open_checked(spec, role))


# ------------------------------------------------------------------ files that are not files
def test_fifo_named_like_an_image_is_refused_without_hanging(tmp_path):
    root = _folder(tmp_path / "d")
    os.mkfifo(root / "a" / "000x.png")
    _refused("000x.png is a FIFO (named pipe), not an image file", lambda: open_checked(DataSpec(data=str(root),
                                                                                               batch_size=4)))
    flat = tmp_path / "flat"
    _png(flat / "1.png")
    os.mkfifo(flat / "0.png")
    _refused("0.png is a FIFO", lambda: open_catalog(str(flat)))


def test_link_to_a_device_is_refused_and_never_read(tmp_path):
    root = _folder(tmp_path / "d")
    os.symlink("/dev/zero", root / "b" / "x.png")
    _refused("x.png is a character device, not an image file", lambda: open_catalog(str(root)))
    listed = tmp_path / "list.txt"
    listed.write_text(f"{root / 'a' / '000.png'}\n/dev/zero\n")
    _refused("line 2: /dev/zero is a character device", lambda: open_catalog(str(listed)))
    os.symlink("/dev/zero", tmp_path / "zero.txt")
    _refused("zero.txt is a character device, not a regular file", lambda: open_catalog(str(tmp_path / "zero.txt")))


def test_every_read_is_a_bounded_regular_file_read(tmp_path, monkeypatch):
    """What the listing cannot see (a file swapped after it, an oversized one) is refused by the read itself."""
    root = _folder(tmp_path / "d", per_class=2)
    cat = open_catalog(str(root))
    (root / "a" / "000.png").unlink()
    os.mkfifo(root / "a" / "000.png")                  # swapped for a FIFO after the listing
    with pytest.raises(OSError, match="FIFO"):
        _within(10, lambda: cat.read(0))
    with pytest.raises(OSError, match="character device"):
        files.read_regular("/dev/zero")
    monkeypatch.setattr(files, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(OSError, match="past the 10-byte limit"):
        files.read_regular(str(root / "b" / "000.png"), 10)


def test_fifo_shard_and_fifo_list_do_not_hang(tmp_path):
    os.mkfifo(tmp_path / "x.tar")
    _refused("tar shard", lambda: open_catalog(str(tmp_path / "x.tar")))
    os.mkfifo(tmp_path / "list.txt")
    _refused("is a FIFO (named pipe), not a regular file", lambda: open_catalog(str(tmp_path / "list.txt")))


def test_brace_pattern_is_bounded_and_checked_as_it_expands(tmp_path):
    start = time.monotonic()
    _refused("names more than 100,000 tar shards", lambda: open_catalog(str(tmp_path / "x-{0000000..9999999}.tar")))
    _refused("x-00000.tar of", lambda: open_catalog(str(tmp_path / "x-{00000..99999}.tar")))
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------ labels
_HUGE = "99999999999999999999999"


@pytest.mark.parametrize("label, fragment", [
    ("10000000", "label 10000000 is past the largest class index unison takes (99,999)"),
    ("1000000000", "label 1000000000 is past the largest class index"),
    (_HUGE, f"label {_HUGE[:20]}... (23 digits) is past the largest class index"),
    ("\u00b2", "label '\u00b2' is not a class index (ASCII digits 0-9)"),
    ("-1", "label '-1' is not a class index"),
], ids=["1e7", "1e9", "overflow", "superscript-two", "negative"])
def test_cls_labels_are_strict_and_bounded(tmp_path, label, fragment):
    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(png, format="PNG")
    shard = _tar(tmp_path / "s.tar", [("k/0.png", png.getvalue()), ("k/0.cls", b"1"),
                                      ("k/1.png", png.getvalue()), ("k/1.cls", label.encode())])
    msg = _refused(fragment, lambda: open_catalog(shard), seconds=10)
    assert "member k/1.cls" in msg


@pytest.mark.parametrize("label, fragment", [
    ("10000000", "line 2: label 10000000 is past the largest class index"),
    (_HUGE, "line 2: label 99999999999999999999... (23 digits) is past"),
], ids=["1e7", "overflow"])
def test_list_labels_are_bounded(tmp_path, label, fragment):
    _png(tmp_path / "a.png")
    (tmp_path / "list.txt").write_text(f"a.png 0\na.png {label}\n")
    _refused(fragment, lambda: open_catalog(str(tmp_path / "list.txt")), seconds=10)


# ------------------------------------------------------------------ strings in file lists
def test_list_strings_are_validated(tmp_path):
    _png(tmp_path / "a.png")
    lst = tmp_path / "list.txt"
    lst.write_bytes(b"a.png\n" * 1000 + b"a\x00.png\n")         # past the binary sniff of the first 4 KiB
    _refused("line 1001 holds the control character '\\x00'", lambda: open_catalog(str(lst)))
    lst.write_text("a.png\n" + "d/" * 2500 + "a.png\n")
    _refused("line 2: the path is 5,005 characters long, past what the file system takes", lambda: open_catalog(
        str(lst)))
    lst.write_bytes(b"a.png\n\xff\xfe.png\n")
    _refused("line 2 is not UTF-8 text", lambda: open_catalog(str(lst)))


def test_list_with_a_byte_order_mark_reads_its_first_path(tmp_path):
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png", 50)
    (tmp_path / "list.txt").write_bytes("\ufeffa.png\nb.png\n".encode())
    cat = open_catalog(str(tmp_path / "list.txt"))
    assert cat.names.tolist() == ["a.png", "b.png"]


# ------------------------------------------------------------------ decompression bombs
def _png_header_only(width: int, height: int) -> bytes:
    """A 1-bit PNG claiming width x height pixels, with a token IDAT (a bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def test_every_decode_path_refuses_a_decompression_bomb(tmp_path, monkeypatch):
    from PIL import Image

    from unison.data.decode import decode_centre
    from unison.data.memory import decode_bytes, load_catalog

    with pytest.raises(Image.DecompressionBombError, match="900000000 pixels"):    # PIL's own refusal, here
        decode_bytes(_png_header_only(30000, 30000))
    monkeypatch.setattr("PIL.Image.MAX_IMAGE_PIXELS", None)    # turned off (by another library): ours holds
    with pytest.raises(ValueError, match="900,000,000 pixels, past the 178,956,970-pixel limit"):
        decode_bytes(_png_header_only(30000, 30000))
    monkeypatch.setattr(files, "MAX_PIXELS", 32 * 32 - 1)    # 33x33 images become bombs: the decode is refused
    root = tmp_path / "d"
    _png(root / "a" / "0.png", 10, size=8)
    _png(root / "b" / "0.png", 10, size=33)
    cat = open_catalog(str(root))
    with pytest.raises(DataError, match="1,089 pixels, past the 1,023-pixel limit"):
        load_catalog(cat, None, "error", 0)
    with pytest.raises(ValueError, match="past the 1,023-pixel limit"):
        decode_centre(cat.read(1), 16)


def test_list_labels_in_other_digits_are_refused(tmp_path):
    """``٣`` beside ``1`` would make the list's labels names (classes '1', '٣'), not the indices meant."""
    _png(tmp_path / "a.png")
    (tmp_path / "list.txt").write_text("a.png 1\na.png \u0663\n")
    _refused("line 2: label '\u0663' is not a class index (ASCII digits 0-9)", lambda: open_catalog(
        str(tmp_path / "list.txt")))


# ------------------------------------------------------------------ found by this branch's own trial
def test_more_paths_that_are_not_images_are_refused(tmp_path):
    import socket

    os.symlink("loop", tmp_path / "loop")                              # --data is a loop of links
    _refused("loop cannot be resolved (Symlink loop", lambda: open_catalog(str(tmp_path / "loop")))
    root = _folder(tmp_path / "d", per_class=2)
    os.symlink("self", root / "a" / "self")                            # links that loop inside the data:
    os.symlink("x.png", root / "b" / "x.png")                          # no traceback from the walk
    assert len(open_catalog(str(root))) == 5
    with socket.socket(socket.AF_UNIX) as s:                           # a socket named like an image
        s.bind(str(root / "a" / "zz.png"))
        _refused("zz.png is a socket, not an image file", lambda: open_catalog(str(root)))
    os.symlink("/dev/zero", tmp_path / "zero.tar")                     # a shard name linked to a device
    _refused("tar shard", lambda: open_catalog(str(tmp_path / "zero.tar")))
    (tmp_path / "dir.txt").write_text(f"{root / 'a' / '000.png'}\n{root / 'a'}\n")
    _refused("line 2: " + str(root / "a") + " is a folder, not an image file", lambda: open_catalog(str(tmp_path / "dir.txt")))
    (tmp_path / "esc.txt").write_text(f"{root / 'a' / '000.png'}\n\x1b[31mred.png\n")
    _refused("line 2 holds the control character '\\x1b'", lambda: open_catalog(str(tmp_path / "esc.txt")))
    _refused("names more than 100,000 tar shards", lambda: open_catalog(str(tmp_path / f"x-{{0..{'9' * 40}}}.tar")))


def test_an_oversized_shard_member_is_not_read(tmp_path, monkeypatch):
    from unison.data import samples

    _png(tmp_path / "a.png")
    shard = _tar(tmp_path / "s.tar", [(f"k/{i}.png", (tmp_path / "a.png").read_bytes()) for i in range(2)])
    cat = open_catalog(shard)
    monkeypatch.setattr(samples, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(OSError, match="past the 10-byte limit"):
        cat.read(0)


def test_a_constant_channel_is_not_normalised_into_nan():
    """Images whose blue channel is 0 everywhere: std 0 made every view NaN (exit 5, 'lower --lr')."""
    import torch

    from unison.data.subsets import channel_stats

    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    images[:, 0] = torch.arange(4, dtype=torch.uint8)[:, None, None] * 60
    mean, std = channel_stats(images)
    assert std[1] == std[2] == 1.0 and 0 < std[0] < 1


# ------------------------------------------------------------------ each sample once, named as it is
def _png_bytes(value: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("pattern, fragment", [
    ("s-{0000..0001}{,}.tar", "names the tar shard {tmp}/s-0000.tar twice"),
    ("s-{{0000..0001},0001}.tar", "names the tar shard {tmp}/s-0001.tar twice"),
    ("s-{0000..0002}.tar", "names the tar shard {tmp}/s-0002.tar twice (also as {tmp}/s-0000.tar: the same file)"),
], ids=["brace-repeats-every-shard", "overlapping-list", "hard-link-to-a-shard"])
def test_a_shard_named_twice_is_refused(tmp_path, pattern, fragment):
    for k in range(2):
        _tar(tmp_path / f"s-{k:04d}.tar", [(f"{k}_{i}.png", _png_bytes(i)) for i in range(4)])
    os.link(tmp_path / "s-0000.tar", tmp_path / "s-0002.tar")   # a hard link: the same file under another name
    _refused(fragment.format(tmp=tmp_path), lambda: open_catalog(str(tmp_path / pattern)))


def test_shard_members_sharing_one_name_are_refused(tmp_path):
    same = _tar(tmp_path / "same.tar", [("same.png", _png_bytes(i)) for i in range(16)])
    _refused("more than one image member is named 'same.png'; each sample needs its own key", lambda: open_catalog(same))
    ok = _tar(tmp_path / "ok.tar", [("k0.png", _png_bytes(0)), ("k0.cls", b"0"), ("k1.png", _png_bytes(1)),
                                    ("k1.cls", b"1")])
    assert len(open_catalog(ok)) == 2


@pytest.mark.parametrize("order", ["adjacent", "apart"])
def test_two_images_under_one_key_are_refused(tmp_path, order):
    """s000.png and s000.jpg: one key, two images (WebDataset would make them one sample); next to each other or
    apart in the tar, it is not 17 samples."""
    members = [(f"s{i:03d}.png", _png_bytes(i)) for i in range(16)]
    members.insert(1 if order == "adjacent" else 16, ("s000.jpg", _png_bytes(99)))
    shard = _tar(tmp_path / "twice.tar", members)
    _refused("the image members 's000.png' and 's000.jpg' share the key 's000'; each sample needs its own key",
             lambda: open_catalog(shard))


def test_a_dangling_link_is_named_a_broken_link(tmp_path):
    root = _folder(tmp_path / "d")
    os.symlink("nowhere", root / "a" / "zz.png")
    _refused(f"data file {root / 'a' / 'zz.png'} is a broken link (to 'nowhere', which does not exist); remove it or "
             "fix the link", lambda: open_catalog(str(root)).file_stats())   # what memory mode keys its cache by
