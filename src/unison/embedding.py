"""The backbone features of every image of a folder, file list or tar shards, in input order (and their names).

    unison embed --checkpoint runs/photos --data /data/photos --out photos.npy               # one process
    unison embed --checkpoint runs/photos --data '/data/s-{0000..0099}.tar' --out s.npy --world-size 8

Writes ``OUT`` (``.npy``: float32 ``[N, feature_dim]``, the backbone's features before any projection head,
not normalised) and beside it ``OUT`` with ``.names.csv`` for ``.npy`` (columns ``file``, ``label``: row k
of the array is the image on line k + 1 of the CSV; ``label`` is its class name, empty for unlabelled
data). The rows follow the input's own order (an ImageFolder by class then path, a flat folder by name, a
list by line, shards by shard then member: the sample order of `unison.data.catalog`). Parquet is not
written: pyarrow is not one of unison's dependencies (``--out x.parquet`` is refused with that line).

Images are read as the kNN evaluation reads them (`unison.data.evalsets.LazyImages`): decoded one batch at
a time at the run's image size (shorter side resized, centre square, EXIF orientation applied) and
normalised with the run's statistics, as recorded in the checkpoint. Memory per process does not grow with
the data: each of the ``--world-size`` processes (unison's launcher, as ``unison train``) embeds a
contiguous share of the images and appends each batch's features to its own part file beside ``OUT``;
the parts are then copied, in rank order, into ``OUT`` (written under a temporary name, renamed when
complete). Unreadable images follow ``--on-corrupt``: ``skip`` leaves them out (not in the CSV either;
one warning with the total), ``error`` stops with one line naming the file.

``--out`` is refused (one line, before anything is loaded) where it is the checkpoint, lies inside the
data or the checkpoint's folder, is a directory, or already exists (``--overwrite`` replaces an existing
output; an input never).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.config.distributed import checked_device
from unison.config.fields import Range, check_fields
from unison.config.train import DATA_LAYOUTS, MAX_BATCH
from unison.errors import ConfigError, Preempted
from unison.paths import OVERWRITE_HELP, write_error

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EmbedOptions:
    checkpoint: str | None = field(default=None, metadata={
        "help": "run directory (its latest checkpoint) or checkpoint file; required", "required": True,
        "metavar": "RUN_DIR_OR_FILE"})
    data: str | None = field(default=None, metadata={
        "help": f"images to embed: {DATA_LAYOUTS}; default: the run's training data (as the run read it, from "
                "any folder)"})
    out: str | None = field(default=None, metadata={
        "help": "features file, .npy (float32 [N, dim]); the file names go to OUT with .names.csv; required",
        "required": True, "metavar": "OUT.npy"})
    overwrite: bool = field(default=False, metadata={"help": OVERWRITE_HELP + " (--out and its names file)"})
    world_size: int = field(default=1, metadata={"range": Range(1, 256),
                                                 "help": "processes embedding a share of the images each"})
    batch_size: int = field(default=256, metadata={"range": Range(1, MAX_BATCH), "help": "images per forward pass"})
    on_corrupt: str = field(default="skip", metadata={"choices": ("skip", "error"),
                            "help": "unreadable images: skip (left out, counted) or error"})
    threads: int | None = field(default=None, metadata={"range": Range(1, 4096),
                                "help": "torch CPU threads per process; default: the cores shared out"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available) | cpu | cuda", "choices": DEVICES})

    def validate(self) -> EmbedOptions:
        for name in ("checkpoint", "out"):
            if not getattr(self, name):
                raise ConfigError(f"give --{name}, e.g. unison embed --checkpoint runs/default --data photos/ "
                                  "--out photos.npy")
        check_fields(self)
        checked_device(self.device)   # the one device check (`unison.load_backbone` and every checkpoint read too)
        return self


def names_path(out: str | Path) -> Path:
    """Where the file names of `out`'s rows go: ``x.npy`` -> ``x.names.csv``."""
    p = Path(out)
    return p.with_name(p.name[:-len(p.suffix)] + ".names.csv" if p.suffix else p.name + ".names.csv")


def check_outputs(opts: EmbedOptions) -> tuple[Path, Path]:
    """``--out`` and its names file, refused (one line) where they would destroy an input or an existing file."""
    from unison.data.spec import BUILTIN
    from unison.paths import Input, check_output
    from unison.training.load import checkpoint_inputs

    assert opts.out and opts.checkpoint and opts.data
    out = Path(opts.out)
    if out.suffix.lower() == ".parquet":
        raise ConfigError(f"--out {out}: Parquet needs pyarrow, which is not one of unison's dependencies; give "
                          f"--out {out.with_suffix('.npy')} (features, and the file names in "
                          f"{names_path(out.with_suffix('.npy')).name})")
    if out.suffix.lower() != ".npy":
        raise ConfigError(f"--out {out}: give a .npy file name (float32 features; the names go beside it as .csv)")
    if opts.data in BUILTIN:
        raise ConfigError(f"--data {opts.data} is a built-in training set; unison embed reads your images: a folder, "
                          "a file list or .tar shards")
    inputs = [*checkpoint_inputs(opts.checkpoint), Input("--data", opts.data, tree=True)]
    names = names_path(out)
    for path, flag in ((out, "--out"), (names, "--out (its names file)")):
        check_output(path, "--out", inputs=inputs, overwrite=opts.overwrite, label=f"{flag} {path}")
    return out, names


def embed_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """One process's share: embed images [start, stop) of the data into ``part-<rank>.f32`` / ``.csv`` in
    ``payload["parts"]``; returns the rows written, the feature dimension and the unreadable images."""
    from unison.data.augment import eval_transform
    from unison.data.evalsets import LazyImages
    from unison.data.source import default_view_size, open_checked, stream_stats
    from unison.data.spec import DataSpec
    from unison.distributed.collectives import contiguous_share
    from unison.distributed.signals import stop_requests
    from unison.eval.knn import embed_all
    from unison.progress import Progress
    from unison.training.load import load_method, preprocessing
    from unison.training.summary import peak_memory_mib, steady_heap

    steady_heap()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    opts = EmbedOptions(**payload["options"])
    device = torch.device(payload["device"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    method, cfg, ckpt = load_method(opts.checkpoint, device)   # type: ignore[arg-type]
    catalog = open_checked(DataSpec(data=str(opts.data), batch_size=1))
    assert catalog is not None   # check_outputs refused the built-in sets
    recorded = preprocessing(cfg, ckpt)
    size = recorded["image_size"] or default_view_size(catalog, str(opts.data)).size
    mean, std = ((recorded["mean"], recorded["std"]) if recorded["mean"]
                 else stream_stats(catalog, np.arange(len(catalog)), size))
    dtype = getattr(torch, cfg.precision)
    mine = contiguous_share(len(catalog), rank, world)
    start, stop = mine.start, mine.stop
    images = LazyImages(catalog, np.arange(start, stop), size, device, opts.on_corrupt)
    parts = Path(payload["parts"])
    rows, dim = 0, 0
    progress = Progress("embed: embedded", stop - start, len(catalog), show=rank == 0)
    with _Part(parts, rank, Path(str(opts.out))) as part:   # out: checked by check_outputs
        for b in range(0, len(images), opts.batch_size):   # one batch in memory at a time
            if stop_requests().requested:   # forwarded by the launcher (`_stop_on_signals`)
                raise _stopped(stop_requests().name(), Path(str(opts.out)))
            chunk = images[b:b + opts.batch_size]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                f, ok = embed_all(method.embed, chunk, lambda x: eval_transform(x, size, mean, std).to(dtype),
                                  opts.batch_size, normalise=False)
            kept = np.ascontiguousarray(f[ok].float().cpu().numpy(), dtype=np.float32)
            labels = [int(catalog.labels[i]) for i in chunk.indices[ok.cpu().numpy()]]
            part.add(kept, [[_csv_safe(catalog.describe(int(i))), catalog.classes[label] if label >= 0 else ""]
                            for i, label in zip(chunk.indices[ok.cpu().numpy()], labels)])
            rows, dim = rows + len(kept), int(kept.shape[1]) if kept.ndim == 2 else dim
            progress(min(b + opts.batch_size, len(images)))
    return {"rows": rows, "dim": dim, "unreadable": dict(images.unreadable.files),
            "peak_memory_mib": round(peak_memory_mib(device), 1)}


class _Part:
    """One rank's share of the output (features and file names, in the parts folder beside ``--out``), written as
    it is embedded; a failed write (a full disk) is `write_error`'s one line, saying that ``--out`` is untouched."""

    def __init__(self, parts: Path, rank: int, out: Path) -> None:
        self.paths = parts / f"part-{rank:05d}.f32", parts / f"part-{rank:05d}.csv"
        self.out = out

    def __enter__(self) -> _Part:
        with self._failures():
            self.feats = open(self.paths[0], "wb")
            self.names = open(self.paths[1], "w", encoding="utf-8", newline="")
            self.writer = csv.writer(self.names)
        return self

    def add(self, feats: np.ndarray, names: list[list[str]]) -> None:
        with self._failures():
            self.feats.write(feats.tobytes())
            self.writer.writerows(names)

    def __exit__(self, *exc: object) -> None:
        with self._failures():   # the buffered rest is written here: a full disk can show first at close
            for f in (getattr(self, "feats", None), getattr(self, "names", None)):
                if f is not None:
                    f.close()

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise write_error(self.out, e, kept=untouched(self.out)) from None


def untouched(out: Path) -> str:
    """What a failed embed leaves: ``--out`` as it was (its parts and temporary files are removed)."""
    return f"the earlier {out.name} is intact" if out.exists() else "no partial file is left"


def _csv_safe(name: str) -> str:
    """A file name as text the CSV can hold (undecodable bytes as \\x escapes)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _assemble(out: Path, names: Path, parts: Path, results: list[dict[str, Any]]) -> int:
    """Copy the ranks' parts, in rank order, into ``out`` (an .npy) and ``names``; returns the rows."""
    rows = sum(r["rows"] for r in results)
    dim = max((r["dim"] for r in results), default=0)
    tmp_out, tmp_names = out.with_name(f".{out.name}.tmp"), names.with_name(f".{names.name}.tmp")
    try:
        with open(tmp_out, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
            for r in range(len(results)):
                with open(parts / f"part-{r:05d}.f32", "rb") as part:
                    shutil.copyfileobj(part, f, 1 << 22)
        with open(tmp_names, "w", encoding="utf-8", newline="") as f:
            f.write("file,label\n")
            for r in range(len(results)):
                with open(parts / f"part-{r:05d}.csv", encoding="utf-8", newline="") as part:
                    shutil.copyfileobj(part, f, 1 << 22)
        os.replace(tmp_out, out)
        os.replace(tmp_names, names)
    except BaseException as e:   # a full disk, or a stop signal (`_stop_on_signals`): no partial output left
        for t in (tmp_out, tmp_names):
            t.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(out, e, kept=untouched(out)) from None
        raise
    return rows


def _stop_on_signals(out: Path) -> contextlib.AbstractContextManager[None]:
    """SIGTERM/SIGUSR1 (``kill``, a cluster's stop) while embedding: one line and exit 75, the part files and any
    temporary output removed by the callers' cleanup (Python's default ends the process at once, exit 143, with
    a hidden ``.OUT.parts-*`` folder left behind). Workers of ``--world-size N`` get the signal from the launcher
    and stop before their next batch (`embed_worker`)."""
    from unison.distributed.signals import stop_signals_raise

    return stop_signals_raise(lambda name: _stopped(name, out))


def _stopped(name: str, out: Path) -> Preempted:
    return Preempted(f"stopped by {name}: {out} was not written (nothing partial is left); run the same command "
                     "again", signal_name=name)


def embed(opts: EmbedOptions) -> dict[str, Any]:
    """Embed ``opts.data`` into ``opts.out`` (see the module docstring); returns a summary."""
    import warnings

    from unison.distributed.env import detect_launch_env

    opts.validate()
    if opts.data is None:
        opts = dataclasses.replace(opts, data=run_data(str(opts.checkpoint)))
    if detect_launch_env() is not None:   # every rank would write the whole output from its share alone
        raise ConfigError("unison embed starts its own processes (--world-size N); run it directly, not under "
                          "torchrun, srun or mpirun")
    out, names = check_outputs(opts)
    with _stop_on_signals(out):
        results, rows = _embed_into(opts, out, names)
    unreadable = {k: v for r in results for k, v in r["unreadable"].items()}
    if unreadable:
        warnings.warn(f"embed: left out {len(unreadable)} unreadable image(s) (--on-corrupt skip), e.g. "
                      f"{next(iter(unreadable.values()))}", stacklevel=2)
    return {"out": str(out), "names": str(names), "rows": rows, "dim": max(r["dim"] for r in results),
            "unreadable": len(unreadable), "peak_memory_mib": [r["peak_memory_mib"] for r in results]}


def _embed_into(opts: EmbedOptions, out: Path, names: Path) -> tuple[list[dict[str, Any]], int]:
    """Embed in ``--world-size`` processes into a hidden parts folder beside `out`, then assemble `out` and
    `names`; the parts folder is removed whatever happens. Returns each process's result and the rows."""
    from unison.config.distributed import DistributedConfig
    from unison.distributed.launch import launch

    device = "cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()) else "cpu"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        parts = Path(tempfile.mkdtemp(prefix=f".{out.name}.parts-", dir=out.parent))
    except OSError as e:
        raise write_error(out, e, kept=untouched(out)) from None
    payload = {"options": dataclasses.asdict(opts), "device": device, "parts": str(parts)}
    try:
        if opts.world_size == 1:
            if opts.threads:
                torch.set_num_threads(opts.threads)
            results = [embed_worker(payload)]
        else:
            results = launch(embed_worker, payload, DistributedConfig(backend="gloo", world_size=opts.world_size),
                             threads_per_worker=opts.threads)
        return results, _assemble(out, names, parts, results)
    finally:
        shutil.rmtree(parts, ignore_errors=True)


def run_data(checkpoint: str) -> str:
    """The training data of the run of `checkpoint`, absolute as the run recorded it (``resolved.data_path``)."""
    from unison.data.spec import BUILTIN
    from unison.training.checkpoint import read_header

    header = read_header(checkpoint)
    given = str(header.config.get("data"))
    data = (header.resolved or {}).get("data_path") or given
    if given in BUILTIN or given.startswith("own:"):
        raise ConfigError(f"{checkpoint} trained on {given}, which unison embed does not read: give --data (a folder, "
                          "a file list or .tar shards)")
    return str(data)


def cmd_embed(ns: argparse.Namespace) -> int:
    from unison.config.fields import overrides_from_namespace

    r = embed(EmbedOptions(**overrides_from_namespace(ns, EmbedOptions)))
    print(f"unison embed: {r['rows']:,} images x {r['dim']} features -> {r['out']} (file names: {r['names']}; "
          f"peak memory per process (MiB): {r['peak_memory_mib']})", file=sys.stdout, flush=True)
    return 0


def add_subcommand(sub: argparse._SubParsersAction, help_text: str) -> None:
    from unison.config.fields import add_options_command

    add_options_command(sub, "embed", help_text,
                        __doc__.splitlines()[0], EmbedOptions, cmd_embed)
