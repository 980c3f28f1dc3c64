"""A run, resolved once: `resolve_run(cfg)` turns what the user gave into the `RunPlan` every worker builds from.

The launching process resolves the run (`unison.training.run`): the whole check of the configuration
(`validate_run`: `TrainConfig.validate` for every field, then the names only the registries of the layers below
know: method, hyper-parameters, backbone, augmentation), the data listed once (`unison.data.source.open_checked`),
the image size it trains at, and the method's recipe at that size (`resolve_recipe`, the one place where the
recipe meets what the user set). Workers receive the plan and decide none of it again: they list no data and
resolve no recipe. `unison check`, `unison plan` and the benchmarks build their step from a plan too
(`plan_run`: the same resolution, without the checks of the launching process).

Example::

    plan = resolve_run(TrainConfig(method="byol", data="/data/photos"))
    plan.recipe        # ResolvedRecipe(backbone='small_cnn', optimizer='sgd', lr=0.06, ...)
    plan.image_size    # 224: the data's shorter side, at most 224
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.config import TrainConfig
from unison.config.fields import article, coerce_fields, did_you_mean, shown, type_error, unknown_keys_message
from unison.data.augment import PRESETS, default_local_size, view_sizes
from unison.data.samples import Catalog
from unison.data.source import check_label_spaces, data_mode_of, open_checked, planned_image_size
from unison.data.spec import DataSpec
from unison.distributed.env import restart_reason
from unison.errors import CheckpointError, ConfigError
from unison.methods import METHODS, Recipe, get_method
from unison.models.backbones import BACKBONES, check_backbone, patch_size_of, resolve_backbone
from unison.models.vit import VIT_BACKBONES, vit_patch_size
from unison.paths import RUN_FILE_ROOM, path_too_long, short_path
from unison.training.checkpoint.files import is_checkpoint_name, latest_checkpoint

if TYPE_CHECKING:   # annotations only (unison.training.own imports this module)
    from unison.data.tensor_dataset import ImageTensorDataset
    from unison.training.pieces import OwnPieces


@dataclass(frozen=True)
class ResolvedRecipe:
    """The optimizer, base learning rate (per 256 images), weight decay, augmentation preset and backbone a run
    uses: the method's recipe for the run's data, overridden by whatever the configuration sets; and what follows
    from the image size (`at_size`): the local crops' side (multi-crop; None: none, or the image size is not known
    yet), and their number where the recipe sets it (`Recipe.global_views_up_to`)."""
    backbone: str
    optimizer: str
    lr: float
    weight_decay: float
    augmentation: str
    local_crop_size: int | None = None
    local_crops: int | None = None   # None: the augmentation's; 0 where the recipe trains 2 views at this size
    global_views: int | None = None  # None: the augmentation's; the method's parameter where it sets the view count
    global_views_up_to: int = dataclasses.field(default=0, repr=False)   # the method's `Recipe`'s

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "global_views_up_to"}

    def at_size(self, cfg: TrainConfig, size: int | None) -> ResolvedRecipe:
        """This recipe at image size `size` (``--image-size`` wins): the local crops of a multi-crop augmentation
        default to 3/7 of the size rounded to a multiple of the backbone's patch size (`default_local_size`), and
        none at all up to `global_views_up_to` px, so that every method trains at its defaults at any even size."""
        size = cfg.image_size or size
        multicrop = self.augmentation in PRESETS and bool(PRESETS[self.augmentation]["n_local"])
        crops = cfg.local_crops
        if crops is None and cfg.local_crop_size is None and multicrop and size is not None \
                and size <= self.global_views_up_to:
            crops = 0   # small images: the 2 global views only (why: `unison.methods._common`)
        local = cfg.local_crop_size
        if local is None and size is not None and multicrop and crops != 0 and not self.backbone.startswith("own:"):
            local = PRESETS[self.augmentation]["local_size"] or default_local_size(
                size, patch_size_of(self.backbone, size, cfg.backbone_args))
        return dataclasses.replace(self, local_crop_size=local, local_crops=crops)


@dataclass(frozen=True)
class RunPlan:
    """One run as resolved (`resolve_run`, `plan_run`): its configuration, the method's recipe at the run's image
    size, the data side's settings and the data as listed. The workers build from it (`build_run`) and resolve
    nothing again; it travels to them pickled (the catalogs as packed arrays)."""

    cfg: TrainConfig                     # validated; the recipe's backbone and the method's parameters filled in
    recipe: ResolvedRecipe               # at `image_size` (local crops sized from it)
    spec: DataSpec                       # what the data side reads of the run (`data_spec`)
    image_size: int | None = None        # the global views' side; None: known only to the build (own dataset)
    catalogs: tuple[Catalog | None, Catalog | None] = (None, None)   # --data and --val as listed (None: built in)
    view_sizes: tuple[int, ...] = ()     # the views the augmenter makes (global, then local crops)

    def resolved(self) -> dict[str, Any]:
        """What ``config.json`` records under ``resolved`` before the build adds what it measured."""
        return self.recipe.as_dict()


def data_spec(cfg: TrainConfig, recipe: ResolvedRecipe | None = None) -> DataSpec:
    """What the data side reads of `cfg` (`unison.data` never sees the training configuration); with the run's
    `recipe`, the local crops it derives from the image size."""
    return DataSpec(data=cfg.data, batch_size=cfg.batch_size, seed=cfg.seed, val=cfg.val, subset=cfg.subset,
                    val_subset=cfg.val_subset, knn_reference=cfg.knn_reference, on_corrupt=cfg.on_corrupt,
                    data_mode=cfg.data_mode, decode=cfg.decode, loader_workers=cfg.loader_workers,
                    image_size=cfg.image_size, world_size=cfg.distributed.world_size,
                    global_views=recipe.global_views if recipe else None,
                    local_crops=recipe.local_crops if recipe else cfg.local_crops,
                    local_crop_size=recipe.local_crop_size if recipe else cfg.local_crop_size,
                    grad_sync_every=cfg.distributed.grad_sync_every)


def resolve_run(cfg: TrainConfig, *, own: OwnPieces | None = None, cuda_available: bool | None = None) -> RunPlan:
    """The launching process's resolution of a run: every check of the configuration (`validate_run`), then the
    data and the recipe (`plan_run`). Raises a one-line `unison.errors` exception for what would fail."""
    return plan_run(cfg, own=own, recipe=_validated(cfg, cuda_available, own))


def plan_run(cfg: TrainConfig, *, train_set: ImageTensorDataset | None = None, own: OwnPieces | None = None,
             recipe: ResolvedRecipe | None = None) -> RunPlan:
    """The data of the validated `cfg` listed once (``--data`` and ``--val``: layout, the size rules, the labels of
    one against the other, a memory mode that fits), the image size the run trains at, and the recipe at that size.
    `train_set`: images given in memory (`unison check`'s, the benchmarks'), which set the image size; `own`: the
    user's dataset, whose size only the build knows; `recipe`: the one `validate_run` resolved, if it ran."""
    catalogs: tuple[Catalog | None, Catalog | None] = (None, None)
    size = cfg.image_size
    if own is None or own.dataset is None:
        spec = data_spec(cfg)
        if train_set is None:
            catalogs = (open_checked(spec, "data"), open_checked(spec, "val"))
            check_label_spaces(spec, *catalogs)   # the rule of the workers' kNN sets
            if spec.data_mode == "memory":   # refused when one decoded copy exceeds the RAM
                data_mode_of(spec, catalogs[0])
        size = planned_image_size(spec, catalogs[0], train_set)
    recipe = recipe.at_size(cfg, size) if recipe is not None else resolve_recipe(cfg, size)
    spec = data_spec(cfg, recipe)
    sizes = tuple(view_sizes({**PRESETS[recipe.augmentation], **spec.augment_overrides()}, size)) if size else ()
    return RunPlan(cfg=cfg, recipe=recipe, spec=spec, image_size=size, catalogs=catalogs, view_sizes=sizes)


def resolve_recipe(cfg: TrainConfig, image_size: int | None = None) -> ResolvedRecipe:
    """The run's recipe: the method's for the run's data (`Recipe.for_data`), each value the configuration sets
    taking its place; `image_size` (the data's, when ``--image-size`` is not given) sizes what depends on it
    (`ResolvedRecipe.at_size`). The recipes' ViTs are ``vit_<size>_auto``: their patch size follows the image size
    (`resolve_backbone` pins it)."""
    recipe = get_method(cfg.method).recipe.for_data(cfg.data)
    return ResolvedRecipe(
        backbone=cfg.backbone or recipe.backbone,
        optimizer=cfg.optimizer or recipe.optimizer,
        lr=cfg.lr if cfg.lr is not None else recipe.base_lr,
        weight_decay=cfg.weight_decay if cfg.weight_decay is not None else recipe.weight_decay,
        augmentation=cfg.augmentation or recipe.augmentation, global_views=_view_count(cfg, recipe),
        global_views_up_to=recipe.global_views_up_to).at_size(cfg, image_size)


def _view_count(cfg: TrainConfig, recipe: Recipe) -> int | None:
    """The number of views the method's parameter `Recipe.views_param` asks for (given, else its default); None
    for the other methods, and for a value that is not a count yet (`validated_method_params` refuses it)."""
    if recipe.views_param is None:
        return None
    given = cfg.method_params.get(recipe.views_param, getattr(get_method(cfg.method).Params(), recipe.views_param))
    return given if isinstance(given, int) and not isinstance(given, bool) and given >= 1 else None


def validate_run(cfg: TrainConfig, cuda_available: bool | None = None, *, own: OwnPieces | None = None) -> TrainConfig:
    """Every field (`TrainConfig.validate`), then the method, its parameters, the backbone and the augmentation;
    fills in the recipe's backbone (what the workers, checkpoints and summary see). `own`: the user's pieces
    (`unison.training.own`), named in `cfg` in place of the backbone and data they replace. Returns `cfg`."""
    _validated(cfg, cuda_available, own)
    return cfg


def _validated(cfg: TrainConfig, cuda_available: bool | None, own: OwnPieces | None) -> ResolvedRecipe:
    """`validate_run`'s checks; returns the recipe they resolved (before the image size is known)."""
    cfg.validate(cuda_available)
    too_long = path_too_long(cfg.out, room=RUN_FILE_ROOM)   # ENAMETOOLONG from wherever --out is first used
    if too_long:
        raise ConfigError(f"--out {short_path(cfg.out)}: {too_long}")
    if cfg.method not in METHODS:
        raise ConfigError(f"method={shown(cfg.method)} is unknown{did_you_mean(cfg.method, METHODS)}; "
                          f"use one of {', '.join(sorted(METHODS))}")
    if own is not None:
        own.check_types()
        own.apply(cfg)
    if cfg.augmentation is not None and cfg.augmentation not in PRESETS:
        raise ConfigError(f"augmentation={shown(cfg.augmentation)} is unknown{did_you_mean(cfg.augmentation, PRESETS)};"
                          f" use one of {', '.join(sorted(PRESETS))}")
    recipe = resolve_recipe(cfg)
    cfg.backbone = recipe.backbone
    if own is None or own.backbone is None:   # the user's backbone: checked by one forward (`check_pieces`)
        _validate_backbone(cfg)
    validate_teacher(cfg)
    _validate_local_crops(cfg, recipe.augmentation)
    _validate_accumulation(cfg)
    # exact accumulation: the method's forward (its queue, its batch checks) sees all K micro-batches of a step
    per_forward = cfg.batch_size * (cfg.distributed.grad_sync_every if exact_accumulation(cfg) else 1)
    cfg.method_params = validated_method_params(
        cfg.method, cfg.method_params, global_batch=per_forward, world_size=cfg.distributed.world_size,
        shared_queue=cfg.distributed.shared_queue)
    # the view count of a method whose parameter sets it, from the parameters as validated
    return dataclasses.replace(recipe, global_views=_view_count(cfg, get_method(cfg.method).recipe))


def exact_accumulation(cfg: TrainConfig) -> bool:
    """Whether a step runs the exact accumulation of `unison.training.accumulate` (K > 1, ``--accumulation
    exact`` and a method whose loss couples samples); otherwise a loss per micro-batch (K = 1: the only one)."""
    return (cfg.distributed.grad_sync_every > 1 and cfg.distributed.accumulation == "exact"
            and get_method(cfg.method).accumulation == "exact")


def _validate_accumulation(cfg: TrainConfig) -> None:
    """What exact accumulation cannot combine with: it re-runs backbones outside the wrapped model and averages
    the gradients itself (no DDP comm hook, no FSDP reduce-scatter, no compiled graph around the interception)."""
    if not exact_accumulation(cfg):
        return
    d = cfg.distributed
    clash = ("--shard full" if d.shard == "full" else f"--grad-compression {d.grad_compression}"
             if d.grad_compression != "none" else "--compile" if cfg.compile else None)
    if clash:
        raise ConfigError(f"--grad-sync-every {d.grad_sync_every} with exact accumulation (the default for "
                          f"{cfg.method}) does not combine with {clash}; drop {clash.split()[0]}, or give "
                          "--accumulation independent (a loss per micro-batch: not one big batch)")


TEACHER_RANDOM = "random"   # ``--teacher random``: a seeded random-init teacher (`unison.training.teacher.RANDOM`)


def needs_teacher(method: str) -> bool:
    """Whether `method` trains against a frozen teacher (distill): the one rule of which runs take ``--teacher``
    (`validate_teacher`) and build one (`unison.training.model.build_method`)."""
    return bool(getattr(get_method(method), "needs_teacher", False))


def resumes_its_teacher(cfg: TrainConfig) -> bool:
    """A resumed distilled run (``--resume``, or a torchrun restart or SLURM requeue that resumes from ``--out``): its
    teacher is the one its checkpoint holds (weights and all), never read again from ``--teacher``
    (`unison.training.preflight.resolve_teacher` refuses another one)."""
    return cfg.teacher is not None and resumed_checkpoint_of(cfg) is not None


def resumed_checkpoint_of(cfg: TrainConfig) -> str | None:
    """What this run resumes from: ``--resume`` (``auto`` once resolved), or ``--out`` for a restarted or requeued
    attempt whose run directory holds a checkpoint; None for a fresh run."""
    if cfg.resume and cfg.resume != "auto":
        return cfg.resume
    if restart_reason() is not None and latest_checkpoint(cfg.out) is not None:
        return cfg.out
    return None


def validate_teacher(cfg: TrainConfig) -> None:
    """distill's teacher options, by name (`unison.training.teacher.resolve_teacher` then reads a teacher run):
    only distill takes them, distill needs ``--teacher``, a weights file needs ``--teacher-backbone``, which must
    be a backbone name; ``--teacher random`` defaults to ``small_cnn``."""
    given = [o for o, v in (("--teacher", cfg.teacher), ("--teacher-backbone", cfg.teacher_backbone)) if v]
    if not needs_teacher(cfg.method):
        if given or cfg.teacher_dtype != "float32":
            given = given or ["--teacher-dtype"]
            raise ConfigError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for --method distill; "
                              f"{cfg.method} trains without a given teacher: leave {'it' if len(given) == 1 else 'them'}"
                              " out")
        return
    if cfg.teacher is None:
        raise ConfigError(f"--method {cfg.method} needs --teacher: a unison run directory or checkpoint, a weights "
                          "file with --teacher-backbone NAME, or 'random' (a random-init teacher, for tests)")
    if cfg.teacher == TEACHER_RANDOM:
        cfg.teacher_backbone = cfg.teacher_backbone or "small_cnn"
    elif resumes_its_teacher(cfg):   # the checkpoint holds the teacher: its file is not read again
        pass
    elif not Path(cfg.teacher).exists():
        raise CheckpointError(f"--teacher {cfg.teacher} does not exist; give a unison run directory or checkpoint, a "
                              "weights file, or 'random'")
    elif Path(cfg.teacher).is_file() and not is_checkpoint_name(Path(cfg.teacher)) and cfg.teacher_backbone is None:
        raise ConfigError(f"--teacher {cfg.teacher} is a weights file: give its architecture with --teacher-backbone "
                          "NAME (e.g. resnet50_imagenet, vit_small, timm:vit_small_patch14_dinov2)")
    name = cfg.teacher_backbone
    if name is not None and name not in BACKBONES and not name.startswith("timm:"):
        raise ConfigError(f"--teacher-backbone {shown(name)} is unknown{did_you_mean(name, BACKBONES)}; use one of "
                          f"{', '.join(BACKBONES)} or timm:<name>")
    if name is not None and name.startswith("timm:"):
        check_backbone(name, cfg.image_size)


def _validate_local_crops(cfg: TrainConfig, augmentation: str) -> None:
    """--local-crops / --local-crop-size are for multi-crop augmentations (whose methods take any number of
    local crops); the others' methods expect a fixed number of views."""
    given = [f for f, v in (("--local-crops", cfg.local_crops), ("--local-crop-size", cfg.local_crop_size))
             if v is not None]
    if given and not PRESETS[augmentation]["n_local"]:
        raise ConfigError(f"{' and '.join(given)} set the local crops of multi-crop methods (dino, ibot, swav, "
                          f"lejepa); {cfg.method} with the {augmentation} augmentation has none: leave them out")


def _validate_backbone(cfg: TrainConfig) -> None:
    assert cfg.backbone is not None   # the recipe's, filled in by `_validated`
    if cfg.backbone.startswith("own:"):   # `unison.training.pieces.OWN`, as config.json records a run's own backbone
        raise ConfigError(f"backbone={shown(cfg.backbone)} names your own backbone; pass the module itself: "
                          "unison.train(cfg, backbone=..., feature_dim=...), and leave the configuration's out")
    if cfg.backbone not in BACKBONES and not cfg.backbone.startswith("timm:"):
        raise ConfigError(f"backbone={shown(cfg.backbone)} is unknown{did_you_mean(cfg.backbone, BACKBONES)}; "
                          f"use one of {', '.join(BACKBONES)} or timm:<name>")
    if cfg.backbone_args and not cfg.backbone.startswith("timm:"):
        raise ConfigError(f"--backbone-arg {', '.join(cfg.backbone_args)} is for timm backbones "
                          f"(--backbone timm:<name>); {cfg.backbone} takes none")
    if cfg.backbone.startswith("timm:"):
        check_backbone(cfg.backbone, cfg.image_size, cfg.backbone_args)
    pinned = resolve_backbone(cfg.backbone, cfg.image_size)   # vit_*_auto: a ConfigError at an odd size
    if pinned in VIT_BACKBONES and cfg.image_size is not None and cfg.image_size % vit_patch_size(pinned):
        patch = vit_patch_size(pinned)
        raise ConfigError(f"image_size={cfg.image_size} is not a multiple of the patch size {patch} of "
                          f"{cfg.backbone}; give --image-size a multiple of {patch} (e.g. "
                          f"{max(patch, cfg.image_size // patch * patch)})" + (
                              f", or --backbone {cfg.backbone.split('_p')[0]}_auto (patches from the image size)"
                              if cfg.image_size % 2 == 0 else ""))


def validated_method_params(method: str, given: dict[str, Any], *, global_batch: int | None = None,
                            world_size: int = 1, shared_queue: bool = True) -> dict[str, Any]:
    """Known names, values of the right type, and each method's ranges (its `Params.__post_init__`); with the run's
    `global_batch` and `world_size`, also what the method's workers check against them (`SSLMethod.check_run`:
    queue lengths). Returns the parameters with numbers coerced as recipes write them."""
    params_cls = get_method(method).Params
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"{unknown_keys_message(unknown, fields, f'{method} parameter')} (--param NAME=VALUE)")
    params = coerce_fields(params_cls, given, "--param ")
    bad = type_error(params, params_cls)
    if bad:
        name, value, typ = bad
        default = getattr(params_cls(), name)
        raise ConfigError(f"--param {name}={shown(value)} must be {article(typ)} {typ} (default {default!r})")
    checked = params_cls(**params)   # the ranges: a one-line ConfigError from check_params
    if global_batch is not None and global_batch < 2:   # every loss compares or normalises over a step's images
        raise ConfigError(f"batch_size={global_batch}: {method} needs at least 2 images per step (over one image a "
                          "contrastive loss is 0 and batch norm fails); give --batch-size 2 or more")
    if global_batch is not None:
        get_method(method).check_run(checked, global_batch=global_batch, world_size=world_size,
                                     shared_queue=shared_queue)
    return params
