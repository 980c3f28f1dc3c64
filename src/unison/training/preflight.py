"""Checks in the launching process of what would otherwise fail in every worker after start-up.

`preflight(plan)` runs before any worker starts (`unison.train` calls it on the run as resolved,
`unison.training.resolve.resolve_run`, which has checked every option and listed the data: layout, image count
against subset and batch, the held-out labels against the training labels), the crop sizes against the
backbone (`check_crops`: a ViT's patch size, a timm model's one input
size; ``--init``, ``--freeze``, ``--layer-decay`` by `unison.training.init.prepare_backbone`, the workers' rule, on a
meta-device backbone), the checkpoint to resume (exists, intact, safe, same method: its header only, the weights are
read once, by the workers) and the run directory: never the data folder nor inside it (nor inside a class
folder the data links to), never a non-empty folder that no unison run wrote (`check_run_dir`), and never a
directory whose later checkpoints a resume from an earlier one would overwrite (`check_resume_target`).
A run's own outputs are the files of its run directory; the directory has one owner while it runs
(`unison.training.owner`). Image decoding and model shapes are checked by the workers, whose errors still
reach the user as one line naming the rank.

`check_model_memory(plan)` estimates the memory the run's model needs and refuses, in one line, a model that cannot
fit. The model is the production one (`unison.training.step.build_method`, what train, check, plan and the
benchmarks build), built on the ``meta`` device: shapes and dtypes, nothing allocated. Its parameters, buffers,
gradients and optimizer state must fit in this machine's memory: RAM for every worker process the run starts here
(the model is built on the CPU first), and the GPU's memory when the workers train on GPUs. Activations come on top,
so a run that passes can still run out of memory; one that fails here would have failed (the traceback of an
allocation of terabytes, or the kernel's out-of-memory kill) after start-up in every worker::

    check_model_memory(resolve_run(cfg))
    # ConfigError: "the model needs about 8.0 TiB ... lower --param proj_hidden_dim=..."
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from unison.config import TrainConfig
from unison.config.fields import ascii_digits
from unison.data.files import MAX_CLASSES
from unison.data.memory import physical_memory
from unison.distributed.elastic import recorded_here
from unison.distributed.env import detect_launch_env, restart_reason
from unison.errors import ConfigError, RunDirRefused
from unison.methods import get_method
from unison.models.backbones import check_backbone, resolve_backbone
from unison.models.vit import VIT_BACKBONES, vit_patch_size
from unison.paths import Input, is_inside, same_file
from unison.training.checkpoint import latest_checkpoint, list_checkpoints
from unison.training.checkpoint.files import CHECKPOINT_DIR, is_checkpoint_name, step_of
from unison.training.init_read import check_backbone_setup
from unison.training.memory import ModelState, model_state
from unison.training.metrics import append_run_log
from unison.training.model import build_method
from unison.training.owner import check_run_dir, set_aside_earlier_run
from unison.training.pieces import OwnPieces
from unison.training.resolve import TEACHER_RANDOM, RunPlan, resumed_checkpoint_of, resumes_its_teacher


def preflight(plan: RunPlan, launched: bool, own: OwnPieces | None = None) -> None:
    """Raise a one-line `ConfigError`/`DataError`/`CheckpointError` for what the workers would fail on. `plan`: the
    run as resolved (its data listed, `unison.training.resolve.resolve_run`); `own`: the user's pieces
    (`unison.training.own.check_pieces`: their dataset replaces the data checks)."""
    own = own or OwnPieces()
    cfg = plan.cfg
    sizes = list(plan.view_sizes) if own.dataset is None else None
    if own.given:   # the user's own pieces: their whole check (a run of unison's own has nothing of it to run)
        from unison.training.own import check_pieces

        check_pieces(plan, own, sizes)
    out = Path(cfg.out)
    check_init_not_replaced(cfg, out)
    if own.backbone is None:   # unison's backbone against the views, and --init, --freeze, --layer-decay against it
        check_crops(cfg, plan.recipe.backbone, sizes or [])
    for inp in (Input("--data", cfg.data), Input("--val", cfg.val or "")):
        for folder, where in _data_folders(inp.path):   # run files would become data (plot.png an image)
            if is_inside(out, folder):
                raise RunDirRefused(f"--out {out} lies inside {inp.what} {inp.path}{where}, which this run reads; "
                                    "choose a run directory outside the data")
    resolve_teacher(cfg)
    if out.name == CHECKPOINT_DIR and (out.parent / "config.json").is_file():   # resuming reads it as RUN_DIR
        raise RunDirRefused(f"--out {out} is the checkpoints folder of the run in {out.parent}; give a run directory: "
                            f"a new one, or --resume {out.parent} to continue that run")
    if cfg.resume:  # missing, truncated, foreign, unsafe or other-method checkpoints fail here, not in W workers
        from unison.training.checkpoint.header import read_header, structure

        header = read_header(cfg.resume, expect_method=structure(cfg))   # header only (method, backbone): no weights
        if restart_reason() is None and not recorded_here(out):   # restarted, requeued, re-formed: its own directory
            check_resume_target(Path(cfg.resume), int(header.step), out)
    if out.exists() and not out.is_dir():   # mkdir would say only "File exists"
        read = " (the checkpoint --resume reads)" if cfg.resume and same_file(out, cfg.resume) else ""
        raise RunDirRefused(f"--out {out} is a file{read}, not a run directory; give a folder for the run's files")
    check_run_dir(out)   # before the lock file or any output is created in it
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {out} ({e.strerror or e}); choose another --out") from None


def check_init_not_replaced(cfg: TrainConfig, out: Path) -> None:
    """``--init`` naming the run directory of a fresh run, or a checkpoint in it: the run would replace (prune) the
    checkpoints it starts from as it saves. Refused (one line) before anything is read or written."""
    if not cfg.init or cfg.resume or resumes_after_restart(cfg):   # a resumed run does not read --init
        return
    if same_file(cfg.init, out) or is_inside(cfg.init, out / CHECKPOINT_DIR):
        raise RunDirRefused(f"--init {cfg.init} is a checkpoint of --out {out}, whose files this fresh run moves "
                            f"aside before it starts; give a new --out (or --resume {out} to continue that run)")


def resolve_teacher(cfg: TrainConfig) -> None:
    """distill's ``--teacher``: apart from ``--out``; a teacher run's checkpoint read as a resume reads it (every
    field; a damaged, unsafe or foreign one is one line), ``--teacher`` pinned to that checkpoint file (the
    workers read it, whatever the run writes meanwhile) and its backbone recorded in ``teacher_backbone``."""
    if cfg.teacher is None:   # no teacher to read: every method but distill (`validate_teacher`)
        return
    from unison.training.checkpoint import load_checkpoint, read_header
    from unison.training.teacher import build_teacher, is_teacher_run, teacher_head_spec, teacher_run_backbone

    if resumes_its_teacher(cfg):   # the teacher its checkpoint holds: not read again
        keep_resumed_teacher(cfg)
        return
    if cfg.teacher == TEACHER_RANDOM:   # head parameters given with --param: DINO's default head's
        _record_head(cfg, teacher_head_spec(cfg, None))
        return
    out = Path(cfg.out)
    if is_inside(out, cfg.teacher) or is_inside(Path(cfg.teacher), out):
        raise RunDirRefused(f"--out {out} and --teacher {cfg.teacher} overlap: this run's files would overwrite or "
                            "shadow the teacher it reads; choose a run directory apart from the teacher")
    if not is_teacher_run(cfg.teacher):   # a weights file: read and matched to the architecture, as workers will
        with torch.device("meta"):
            build_teacher(cfg, cfg.image_size)
        return
    header = read_header(cfg.teacher)
    ckpt = load_checkpoint(header.path, run=True)
    _record_head(cfg, teacher_head_spec(cfg, ckpt))   # loss=dino: a DINO head in the teacher (the workers' rule)
    trained = teacher_run_backbone(ckpt)
    given = cfg.teacher_backbone
    if given is not None and given != trained and not trained.startswith(given + "_"):
        raise ConfigError(f"--teacher-backbone {given} is not the backbone of the teacher run {cfg.teacher} "
                          f"({trained}); leave --teacher-backbone out for a unison run")
    cfg.teacher, cfg.teacher_backbone = str(header.path), trained


def keep_resumed_teacher(cfg: TrainConfig) -> None:
    """A resumed distilled run keeps the teacher its checkpoint holds (its weights are read from there, its file is
    not needed): ``--teacher`` naming that teacher (its pinned checkpoint, or the run directory holding it) is
    taken, any other is refused (one line), and the run records the checkpoint's teacher."""
    resumed = resumed_checkpoint_of(cfg)
    assert resumed is not None and cfg.teacher is not None
    from unison.training.checkpoint import read_header

    recorded = read_header(resumed).config
    teacher = recorded.get("teacher")
    if not isinstance(teacher, str):   # not a distilled run's checkpoint: the method check refuses it
        return
    given = cfg.teacher
    if not (given == teacher or same_file(given, teacher) or (given != TEACHER_RANDOM and is_inside(teacher, given))):
        raise ConfigError(f"--teacher {given} is not the teacher of the run resumed from {resumed} ({teacher}, "
                          "whose weights its checkpoint holds): a resumed run keeps its teacher; leave --teacher "
                          f"out, or distil from {given} in a new run (a new --out, without --resume)")
    cfg.teacher = teacher
    cfg.teacher_backbone = recorded.get("teacher_backbone") or cfg.teacher_backbone


def _record_head(cfg: TrainConfig, spec: dict | None) -> None:
    """loss=dino: the teacher head's shape, learnt once here, in the config as the run records it (so the memory
    estimate builds the student's head from it instead of reading the teacher's checkpoint again)."""
    if spec is not None:
        from unison.methods.distill import head_params  # a distill run's: no other run imports it

        cfg.method_params = {**cfg.method_params, **head_params(spec)}


def check_crops(cfg: TrainConfig, backbone: str, sizes: list[int]) -> None:
    """The views the workers' augmenter will make (`sizes`, `planned_view_sizes`'s; none known for the user's own
    dataset; multi-crop: global and local crops), against what the backbone takes (a ViT's patch size, a timm model
    built for one input size): the workers' build applies the same rule (`unison.models.backbones.check_view_sizes`),
    here before any of them starts."""
    if len(set(sizes)) > 1:
        check_backbone(backbone, sizes[0], cfg.backbone_args, sizes)
    # the workers' rule; a restart that resumes from the run directory reads no --init there either
    setup = dataclasses.replace(cfg, init=None) if resumes_after_restart(cfg) else cfg
    check_backbone_setup(setup, backbone, sizes[0] if sizes else cfg.image_size)
    name = resolve_backbone(backbone, sizes[0] if sizes else cfg.image_size)
    method = get_method(cfg.method)   # its views against the backbone's patches, as every worker's build checks them
    method.check_views(method.Params(**cfg.method_params), vit_patch_size(name) if name in VIT_BACKBONES else None,
                       sizes)


def resumes_after_restart(cfg: TrainConfig) -> bool:
    """A restarted or requeued attempt whose run directory has a checkpoint: the workers resume from it
    (`unison.training.trainer`), whatever the command says."""
    restarted = restart_reason() is not None or recorded_here(cfg.out)   # torchrun: a re-formed group of this job
    return restarted and latest_checkpoint(Path(cfg.out)) is not None


def _data_folders(path: str | Path) -> Iterator[tuple[Path, str]]:
    """The folders a data path reads: itself and each class folder, with where each really is (a class folder
    may be a link to a folder elsewhere, whose images the run reads all the same)."""
    root = Path(path)
    if not path or not root.exists():
        return
    yield root, ""
    if not root.is_dir():
        return
    with os.scandir(root) as entries:
        for _, e in zip(range(MAX_CLASSES + 1), entries):
            if e.is_symlink() and os.path.isdir(e.path):
                yield Path(e.path), f" (its class folder {e.name} is a link to {os.path.realpath(e.path)})"


def set_aside_other_run(cfg: TrainConfig) -> None:
    """A run that does not continue the run already in its directory (a fresh run; a resume from another run's
    checkpoint) moves that run's files aside (`unison.training.owner.set_aside_earlier_run`: every file, into
    ``earlier-runs/<time>/``) and says in one line what moved where, so two runs never mix their checkpoints,
    metrics.csv, plot.png, train.log, ... and ``--resume auto`` later continues this run. Called by the
    directory's owner, holding its lock, before any worker starts."""
    out = Path(cfg.out)
    if _continues(cfg, out):
        return
    given = (("--data", cfg.data), ("--val", cfg.val), ("--init", cfg.init), ("--teacher", cfg.teacher),
             ("--resume", cfg.resume))
    inputs = [Input(what, path) for what, path in given if path and os.path.lexists(path)]   # not digits, random
    moved = set_aside_earlier_run(out, inputs)
    if moved is None:
        return
    folder, names = moved
    latest = latest_checkpoint(folder)
    what = f"an earlier run (checkpoints up to {latest.name})" if latest is not None else "files of an earlier run"
    shown_names = ", ".join(n + ("/" if (folder / n).is_dir() else "") for n in names[:8]) + (
        ", ..." if len(names) > 8 else "")
    line = (f"unison: {out} held {what}: moved {shown_names} to {folder}, so this run starts in an empty folder"
            + (f" (--resume {folder} continues that run)" if latest is not None else ""))
    print(line, file=sys.stderr)
    append_run_log(out, line)


def _continues(cfg: TrainConfig, out: Path) -> bool:
    """This run continues the run in `out`: it resumes from one of `out`'s own checkpoints, or it is a restarted or
    requeued attempt that resumes from them by itself (whatever its ``--resume`` says: a branched run's requeue
    repeats the command that branched it)."""
    if resumes_after_restart(cfg):
        return True
    if not cfg.resume:
        return False
    if same_file(cfg.resume, out):   # `--resume OUT`: the run in OUT, whatever its latest checkpoint is or points to
        return True
    source = resumed_checkpoint(Path(cfg.resume))
    # the folder the checkpoint lies in, not where a link in it points: a link in OUT/checkpoints is still OUT's
    return source is not None and is_inside(source.parent, out / CHECKPOINT_DIR)


def resumed_checkpoint(resume: Path) -> Path | None:
    """The checkpoint ``--resume`` names: the file (or ``.dcp``) itself, or a run directory's latest."""
    return resume if not resume.is_dir() or is_checkpoint_name(resume) else latest_checkpoint(resume)


def check_resume_target(resume: Path, step: int, out: Path) -> None:
    """Resuming from `resume` (at `step`) writes the later checkpoints into `out`: refuse (one line) when `out`
    holds checkpoints later than it that are not where it continues, i.e. `resume` is not `out`'s latest."""
    source = resumed_checkpoint(resume)
    latest = latest_checkpoint(out)
    if source is None or latest is None or same_file(source, latest):
        return
    later = [p for p in list_checkpoints(out) if step_of(p) > step]
    if not later:
        return
    own = is_inside(source, out)
    what = (f"--resume {resume} is step {step} of the run in {out}, whose latest checkpoint is {latest.name}" if own
            else f"--out {out} holds checkpoints up to {later[-1].name}, later than --resume {resume} (step {step})")
    raise RunDirRefused(f"{what}: resuming into {out} would overwrite its later checkpoints; pass a new --out DIR to "
                      f"branch from step {step}, or --resume {out} to continue {'its' if own else 'that run from its'} "
                      "latest")


# ---- the model's memory

def model_bytes(plan: RunPlan) -> ModelState:
    """One rank's model state for the resolved run `plan` (`unison.training.memory.model_state`), from a build on
    the meta device: shapes and dtypes, nothing allocated."""
    cfg, recipe = plan.cfg, plan.recipe
    meta = torch.device("meta")
    with meta:
        method = build_method(cfg, 1, getattr(torch, cfg.precision), meta, cfg.image_size, backbone=recipe.backbone,
                              teacher_weights=False)
    return model_state(method, cfg, recipe.optimizer)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _gpu_memory(cfg: TrainConfig) -> int | None:
    """Memory of one GPU when the workers train on GPUs (as `init_distributed` decides), else None."""
    d = cfg.distributed
    if not torch.cuda.is_available() or not (d.communication_backend() == "nccl" or d.resolved_backend() == "local"):
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def _local_workers(cfg: TrainConfig) -> int:
    """Worker processes on this machine: unison's launcher starts them all here; under torchrun/srun/mpirun only
    torchrun says how many (LOCAL_WORLD_SIZE), else one is assumed (the others may be on other machines)."""
    if detect_launch_env() is None:
        return cfg.distributed.world_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if ascii_digits(local) and 1 <= int(local) <= cfg.distributed.world_size else 1


def check_model_memory(plan: RunPlan) -> None:
    """Raise a one-line `ConfigError` when the model of the resolved run `plan` (parameters, buffers, gradients and
    optimizer state) cannot fit in this machine's memory, naming the size and what to lower."""
    cfg = plan.cfg
    state = model_bytes(plan)
    # each worker builds the whole model before FSDP2 shards it; gradients and optimizer state come sharded
    per_worker, weights, largest = state.built + state.grads + state.optimizer, state.built, state.largest
    local = _local_workers(cfg)
    gpu = _gpu_memory(cfg)
    ram = physical_memory()
    if gpu is not None and per_worker > gpu:
        need, have, where = per_worker, gpu, "one GPU has"
    elif ram is not None and (weights if gpu is not None else per_worker) * local > ram:
        need, have = (weights if gpu is not None else per_worker) * local, ram
        where = "this machine has" if local == 1 else f"its {local} worker processes share"
    else:
        return
    given = [f"{k}={v}" for k, v in cfg.method_params.items() if isinstance(v, int) and not isinstance(v, bool)]
    lower = (f"lower --param {', '.join(given)}" if given else "choose a smaller --backbone") + \
        (" or --world-size" if local > 1 and gpu is None else "")
    raise ConfigError(f"the model needs about {_size(need)} (parameters, gradients and optimizer state; the largest "
                      f"tensor is {largest}) and {where} {_size(have)} of memory; {lower}")
