"""The interface every method implements, and the registry the CLI reads.

A method is an `nn.Module` whose ``forward(views) -> loss`` returns *this rank's* loss:
the mean over its local samples of the per-sample loss, written so that the mean over
ranks equals the loss of one process on the global batch (collectives from
`unison.distributed.collectives` provide the global batch where the loss needs it).
The whole method is wrapped in DDP, so online parameters get averaged gradients; state
that is not trained by gradient (momentum encoders, queues, centres) is declared with
`mark_rank_local_state` so DDP never re-broadcasts it.

With ``--grad-sync-every K`` the forward runs once on all K micro-batches of a step (`accumulation`), the
backbones re-run per micro-batch by `unison.training.accumulate`: queue/centre updates in the forward and
``on_after_step`` then happen once per optimiser step, as with one big batch.

``on_after_step(step)`` runs after every optimiser step (EMA updates, schedules).
``embed(x)`` returns backbone features for evaluation. A method that draws per-sample
randomness in its forward (masks of MAE, iBOT, I-JEPA) sets ``needs_sample_keys = True``
and is called as ``forward(views, keys=SampleKeys(seed, epoch, indices))``: drawing from
`unison.rng` with these keys makes a sample's masks independent of the world size
and of the rank it lands on. A method that also sets ``needs_crop_geometry`` gets each view's crop box (flip and
rotation included) in the keys, ``keys.crops``, from the batch source that cut the views (VICRegL matches the
feature-map cells of two views by where they lie in the image).

Each method declares a dataclass of hyper-parameters (published defaults) and the
recipe it was tuned with (optimizer, base learning rate per 256 images, weight decay,
augmentation preset, and the backbone `unison train` and `unison check` use when none is
given: ``small_cnn``, or a ViT for the methods that need patch tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.nn as nn

from unison.optim.schedule import Stretch


@dataclass(frozen=True)
class Recipe:
    optimizer: str = "sgd"
    base_lr: float = 0.06          # per 256 images (scaled linearly with the global batch)
    weight_decay: float = 5e-4
    augmentation: str = "simclr"   # preset in unison.data.augment
    backbone: str = "small_cnn"    # used when --backbone is not given (a ViT for the masked-image methods)
    # Multi-crop methods: at this image size and below, no local crops unless --local-crops asks (the 2 global
    # views only); 0: the augmentation's local crops at every size
    global_views_up_to: int = 0
    # The `Params` field that sets how many views of the image size the augmentation makes (its ``n_global``), for
    # the methods whose view count is a hyper-parameter (MMCR's views, EMP-SSL's patches); None: the preset's
    views_param: str | None = None
    # Overrides of the fields above for the embedded digits default, a 150-step schedule on which
    # some published CIFAR settings barely move (benchmarks/methods_digits.sh runs them).
    embedded: dict[str, Any] = field(default_factory=dict)

    def for_data(self, data: str) -> Recipe:
        """The recipe for `data`: on the embedded digits, their own augmentation (grey, not
        mirror-symmetric; multi-crop, single-crop and FastSiam's four views kept as such) and the `embedded`
        overrides."""
        if data != "digits":
            return self
        preset = {"multicrop": "digits_multicrop", "msn": "digits_multicrop", "dinov2": "digits_multicrop",
                  "crop": "digits_crop", "distill": "digits_crop", "simmim": "digits_crop", "aim": "digits_crop",
                  "capi": "digits_crop", "fastsiam": "digits_fastsiam", "patches": "digits_patches"}.get(
                      self.augmentation, "digits")
        return replace(self, **{"augmentation": preset, **self.embedded})


@dataclass(frozen=True)
class SampleKeys:
    """What per-sample randomness may depend on: (seed, epoch, sample index), never the rank; for a method that
    sets ``needs_crop_geometry``, also where each view lies in its image (`crops`)."""

    seed: int
    epoch: int
    indices: torch.Tensor   # int64 [local batch], this rank's sample indices
    # float64 [local batch, views, 2, 3]: view v of sample b maps its normalised coordinates (x, y in [-1, 1]) to its
    # image's pixels by crops[b, v] @ (x, y, 1) (`unison.data.augment.ViewAugmenter.view_geometry`)
    crops: torch.Tensor | None = None


class SSLMethod(nn.Module):
    name: ClassVar[str]
    Params: ClassVar[type]
    recipe: ClassVar[Recipe] = Recipe()
    # True: forward(views, keys=SampleKeys(...)) — the method draws per-sample randomness (masks).
    needs_sample_keys: ClassVar[bool] = False
    # True (with needs_sample_keys): the keys carry each view's crop in its image (``keys.crops``), what dense
    # methods match feature-map locations by (VICRegL)
    needs_crop_geometry: ClassVar[bool] = False
    # How --grad-sync-every K > 1 accumulates with --accumulation exact: "exact" (one forward on the step's K
    # micro-batches, backbones re-run per micro-batch: `unison.training.accumulate`), or "plain" for a loss that
    # is a mean of per-sample terms with no batch statistics (a loss per micro-batch, averaged, is then exact).
    accumulation: ClassVar[str] = "exact"
    # Why a run at W workers may differ from one process on the global batch (None = exact).
    inexact_reason: ClassVar[str | None] = None
    # Children whose parameters forward() reads directly (not through their own forward), e.g.
    # F.linear(z, self.prototypes.weight): under --shard full they stay in the method's own FSDP unit,
    # which gathers them for the method's forward.
    unsharded_children: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        """Raise `ConfigError` for hyper-parameters that do not fit the run's global batch and world size (a queue
        length, ...). The pre-flight calls it (`unison.training.resolve.validated_method_params`) with the numbers
        the workers will see, and the methods' own step-time checks call the same code."""

    @classmethod
    def smallest_batch(cls, params: Any) -> int:
        """The smallest global batch one forward of this method is defined on at `params` (under exact accumulation
        a forward takes the step's K micro-batches): 2, since over one image a contrastive loss is 0 and batch norm
        fails; more where a batch statistic needs it (W-MSE's whitening). `check_run` refuses a smaller batch with
        the method's reason; `unison check` and the defaults' tests size their batches by it."""
        return 2

    @classmethod
    def init_backbone(cls, backbone: nn.Module, params: Any) -> None:
        """Initialise parts of a backbone unison built as the method's paper does (AIM: fixed 2-D sin-cos positions).
        The training layer calls it before ``--init``'s weights are read into the backbone, so that those win, and
        not on a backbone you pass yourself (`unison.training.model.build_method`)."""

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        """Raise `ConfigError` for views of `view_sizes` px this method cannot train on with a backbone of `patch`
        px patches (None: not a ViT), e.g. I-JEPA's target blocks leaving no context. The pre-flight calls it
        (`unison.training.preflight.check_crops`) and so does every worker's build (`build_method`)."""

    def __init__(self, backbone: nn.Module, feature_dim: int, params: Any, *, gather_distributed: bool = True,
                 shared_queue: bool = True, steps_total: int = 1):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = feature_dim
        self.params = params
        self.gather_distributed = gather_distributed
        self.shared_queue = shared_queue
        self.steps_total = steps_total
        self.stretch: Stretch | None = None   # a budgeted run re-planned late (`unison.optim.schedule.Stretch`)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def schedule_step(self, step: float) -> float:
        """Where optimiser step `step` falls on the method's schedules of `steps_total` steps: `step` itself,
        unless a budgeted run was re-planned late (`stretch`). Every schedule of a method reads its step here."""
        return step if self.stretch is None else self.stretch.position(step)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        """Called after optimiser step `step` (0-based) of `self.steps_total`."""

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def resolved_params(self) -> dict[str, Any]:
        """Parameters the method resolved from the run (not given by the user) that rebuilding it needs: the
        training layer records them in the run's config, so eval/export need neither the data nor a teacher."""
        return {}

    def exactness_note(self) -> str | None:
        """Why this configuration is not equivalent to one process on the global batch, or None."""
        if not self.gather_distributed:
            return "gather is off: each rank's loss sees only its local batch"
        return self.inexact_reason
