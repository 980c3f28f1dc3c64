"""Lightly SSL's model of MSN, PMSN, SimMIM, AIM and CAPI for `unison bench lightly`, the ViT methods whose loss reads
patch tokens: each side is Lightly's ViT wrapper around a timm ViT of the shared ViT's architecture (as MAE's,
`benchmarks.lab.lightly_models.MAESide`), its heads, loss and training step, from Lightly's modules only.

As `benchmarks.lab.lightly_models` (its `Side`): which Lightly example or benchmark each follows, and the recipe and
transform that go with it, are in `benchmarks.lab.lightly_methods`. Lightly is imported inside the methods, so this
module imports without it.

Example::

    model = MSNSide(backbone, 192)
    loss = model.training_loss(views, step, total_steps)   # views: the method's Lightly transform, batched
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn

from .lightly_models import Side, lightly_momentum_copy, timm_vit_like, vit_spec


class MSNSide(Side):
    """Lightly's MSN example: `MaskedVisionTransformerTIMM` (the trained anchor encoder, 15 % of the patches of the
    anchor and focal views dropped) and its EMA copy for the target view (momentum 0.996), `MSNProjectionHead`
    (2048 wide, 256 out), 1024 prototypes, `MSNLoss` (PMSN: `PMSNLoss`). The example hands the loss
    ``prototypes.data``, so its prototypes never learn; this side gives it the parameter, as the loss documents
    (``prototypes=model.prototypes``), so that they train as in the paper."""

    def __init__(self, backbone: nn.Module, dim: int, loss: str = "MSNLoss"):
        import lightly.loss
        from lightly.models.modules import MaskedVisionTransformerTIMM
        from lightly.models.modules.heads import MSNProjectionHead

        vit = timm_vit_like(backbone, "MSN", dynamic_img_size=True)   # focal views are smaller than the image
        super().__init__(MaskedVisionTransformerTIMM(vit=vit))
        self.mask_ratio = 0.15
        self.patch_size = int(vit.patch_embed.patch_size[0])
        self.projection_head = MSNProjectionHead(input_dim=vit.embed_dim)
        self.target_backbone = lightly_momentum_copy(self.backbone)
        self.target_projection_head = lightly_momentum_copy(self.projection_head)
        self.prototypes = nn.Linear(256, 1024, bias=False).weight
        self.criterion = getattr(lightly.loss, loss)()

    def _masked(self, images: torch.Tensor) -> torch.Tensor:
        from lightly.models import utils

        length = (images.shape[-1] // self.patch_size) ** 2 + 1   # + the class token, which stays
        idx_keep, _ = utils.random_token_mask(size=(images.shape[0], length), mask_ratio=self.mask_ratio,
                                              device=images.device)
        return self.projection_head(cast(Any, self.backbone)(images=images, idx_keep=idx_keep))

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.target_backbone, 0.996)
        update_momentum(self.projection_head, self.target_projection_head, 0.996)
        with torch.no_grad():
            targets = self.target_projection_head(cast(Any, self.target_backbone)(images=views[0]))
        anchors = torch.cat([self._masked(views[1]), self._masked(torch.cat(views[2:]))])
        return self.criterion(anchors, targets, self.prototypes)

class PMSNSide(MSNSide):
    """Lightly's MSN example with `PMSNLoss` (power-law prior), as Lightly's PMSN page says to build it."""

    def __init__(self, backbone: nn.Module, dim: int):
        super().__init__(backbone, dim, loss="PMSNLoss")


class SimMIMSide(Side):
    """Lightly's SimMIM benchmark: `MaskedVisionTransformerTIMM` with a mask token, 60 % of the patches masked in
    2 x 2 cells (``random_grid_token_mask``), a linear decoder to the pixels, ``nn.L1Loss`` on the masked patches."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules import MaskedVisionTransformerTIMM

        vit = timm_vit_like(backbone, "SimMIM")
        super().__init__(MaskedVisionTransformerTIMM(vit=vit))
        self.patch_size = int(vit.patch_embed.patch_size[0])
        self.sequence_length = int(vit.patch_embed.num_patches) + int(vit.num_prefix_tokens)
        self.decoder = nn.Linear(vit.embed_dim, self.patch_size ** 2 * 3)
        self.criterion = nn.L1Loss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models import utils

        images, encoder = views[0], cast(Any, self.backbone)
        _, idx_mask = utils.random_grid_token_mask(size=(images.shape[0], self.sequence_length), mask_ratio=0.6,
                                                   grid_size=2, num_prefix_tokens=1, device=images.device)
        encoded = encoder.encode(images=images, idx_mask=idx_mask)
        pred = self.decoder(utils.get_at_index(encoded, idx_mask))
        return self.criterion(pred, utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1))


class _AveragedTokens(nn.Module):
    """The features of Lightly's causal ViT as timm's ``forward`` makes them (all tokens seen, averaged): that
    ``forward`` hands ``forward_features`` timm's ``attn_mask``, which Lightly 1.6.0's override does not take."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = cast(Any, self.vit)
        return vit.forward_head(vit.forward_features(x))


class AIMSide(Side):
    """Lightly's AIM example: `MaskedCausalVisionTransformer` (no class token, 2-D sin-cos positions, features
    averaged for the kNN), a random prefix per sample, `AIMPredictionHead` of 1 block, ``nn.MSELoss`` of every
    token's prediction against its own patch, normalised (``normalize_mean_var``), as the example computes it."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models import utils
        from lightly.models.modules import AIMPredictionHead, MaskedCausalVisionTransformer

        spec = vit_spec(backbone, "AIM")
        vit = MaskedCausalVisionTransformer(**spec, num_classes=0, qk_norm=False, class_token=False,
                                            no_embed_class=True, global_pool="avg")
        utils.initialize_2d_sine_cosine_positional_embedding(pos_embedding=vit.pos_embed, has_class_token=False)
        super().__init__(_AveragedTokens(vit))
        self.patch_size = spec["patch_size"]
        self.num_patches = int(vit.patch_embed.num_patches)
        self.projection_head = AIMPredictionHead(input_dim=vit.embed_dim, output_dim=3 * self.patch_size ** 2,
                                                 num_blocks=1)
        self.criterion = nn.MSELoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models import utils

        images, vit = views[0], cast(Any, self.backbone).vit
        mask = utils.random_prefix_mask(size=(images.shape[0], self.num_patches),
                                        max_prefix_length=self.num_patches - 1, device=images.device)
        features = vit._pos_embed(vit.forward_features(images, mask=mask))   # the example's positions before the head
        patches = utils.normalize_mean_var(utils.patchify(images, self.patch_size), dim=-1)
        return self.criterion(self.projection_head(features), patches)


class CAPISide(Side):
    """Lightly's CAPI example: `MaskedVisionTransformerTIMM` (the student, on the visible patches of
    ``random_inverse_block_mask`` at 65 %) and its EMA copy for the whole image (momentum 0.996 -> 1 by a cosine),
    `CAPIPredictorTIMM` of 2 blocks (the example's 6 heads are ViT-S's; here the shared ViT's), the weight-normalised
    student `CAPIProjectionHead` and the teacher's with a bias, 1024 clusters, `CAPILoss` for the student's targets
    and, on the teacher's logits alone, for the clustering; the two losses summed, as the example trains them."""

    def __init__(self, backbone: nn.Module, dim: int):
        import lightly.loss
        from lightly.models.modules import CAPIPredictorTIMM, CAPIProjectionHead, MaskedVisionTransformerTIMM

        vit = timm_vit_like(backbone, "CAPI")
        super().__init__(MaskedVisionTransformerTIMM(vit=vit))
        encoder = cast(Any, self.backbone)
        self.sequence_length = int(encoder.sequence_length)
        self.num_prefix_tokens = int(vit.num_prefix_tokens)
        heads = int(cast(Any, vit.blocks[0]).attn.num_heads)
        self.student_head = CAPIProjectionHead(input_dim=vit.embed_dim, num_clusters=1024, weight_norm=True)
        self.predictor = CAPIPredictorTIMM(embed_dim=vit.embed_dim, grid_size=int(vit.patch_embed.grid_size[0]),
                                           depth=2, num_heads=heads)
        self.teacher_backbone = lightly_momentum_copy(self.backbone)
        self.teacher_head = CAPIProjectionHead(input_dim=vit.embed_dim, num_clusters=1024, bias=True)
        self.criterion = lightly.loss.CAPILoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models import utils
        from lightly.utils.scheduler import cosine_schedule

        utils.update_momentum(self.backbone, self.teacher_backbone,
                              cosine_schedule(step=step, max_steps=steps, start_value=0.996, end_value=1.0))
        images, prefix = views[0], self.num_prefix_tokens
        idx_keep, idx_mask = utils.random_inverse_block_mask(size=(images.shape[0], self.sequence_length),
                                                             mask_ratio=0.65, num_prefix_tokens=prefix,
                                                             device=images.device)
        visible = cast(Any, self.backbone).encode(images=images, idx_keep=idx_keep)
        predicted = self.predictor(context=visible[:, prefix:], context_positions=idx_keep[:, prefix:] - prefix,
                                   query_positions=idx_mask - prefix)
        student_logits = self.student_head(predicted)
        with torch.no_grad():
            features = cast(Any, self.teacher_backbone).encode(images=images)
        teacher_logits = self.teacher_head(features)[:, prefix:]
        student_loss = self.criterion(teacher_logits=teacher_logits, student_logits=student_logits,
                                      teacher_index=idx_mask - prefix)
        return student_loss + self.criterion(teacher_logits=teacher_logits, student_logits=teacher_logits)
