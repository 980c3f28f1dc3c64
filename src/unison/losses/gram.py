"""Gram anchoring (Siméoni et al., 2025, DINOv3): the student's patch similarities regressed onto a Gram teacher's.

For each image b, the L2-normalised patch features X_b [N, D] of the student and G_b [N, D] of the Gram
teacher (an earlier snapshot of the EMA teacher, no gradient), and their Gram matrices of cosine similarities:

    L_Gram = (1/B) sum_b (1/N**2) || X_b X_b^T - G_b G_b^T ||_F**2

the mean squared difference over every entry of the B [N, N] matrices: DINOv3's ``GramLoss`` with its Gram
anchoring configuration's settings (``normalized: true``, ``img_level: true``: one matrix per image,
``remove_neg: false``: negative similarities kept), where ``torch.nn.MSELoss`` averages over the [B, N, N]
entries, which is this mean over images of per-image means (every image has N patches). It anchors the
patch-level structure the student had earlier in training without constraining the features themselves:
any rotation of them leaves it unchanged.

Distributed semantics: the term is per image (nothing is gathered: DINOv3's batch-level variant,
``img_level: false``, would compare patches across the images of each GPU's batch, a loss that depends on how
the batch is split; it is not offered). Every rank's loss is the mean over its local images, so with equal
local batches the mean over ranks is the global-batch loss and DDP's average its exact gradient. It runs in
float32 under AMP (a product of [N, D] features, as DINOv3 casts them to float).

Example::

    gram = GramAnchoringLoss()
    loss = gram(student_patch_tokens, gram_teacher_patch_tokens)    # [B, N, D] each
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._precision import in_full_precision


def gram_matrix(x: torch.Tensor) -> torch.Tensor:
    """[B, N, N]: the cosine similarities of each image's N features [B, N, D]."""
    x = F.normalize(x, dim=-1)
    return x @ x.transpose(-1, -2)


def _gram_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return (gram_matrix(student) - gram_matrix(teacher)).square().mean()


class GramAnchoringLoss(nn.Module):
    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """student: [B, N, D] patch features (with gradient); teacher: the Gram teacher's, same shape."""
        if student.dim() != 3 or student.shape != teacher.shape:
            raise ValueError(f"expected student and teacher patch features of one shape [B, N, D], got "
                             f"{tuple(student.shape)} and {tuple(teacher.shape)}")
        return in_full_precision(_gram_loss, student, teacher.detach())
