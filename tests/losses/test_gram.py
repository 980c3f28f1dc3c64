"""Gram anchoring's loss against DINOv3's ``GramLoss`` (its anchoring configuration, written out here), its
invariances, its per-image form (what makes it exact under DDP), its precision and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unison.losses import GramAnchoringLoss, gram_matrix


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _dinov3_gram_loss(output_feats: torch.Tensor, target_feats: torch.Tensor) -> torch.Tensor:
    """dinov3/loss/gram_loss.py GramLoss(apply_norm=True, remove_neg=False).forward(img_level=True), as
    dinov3_vit7b16_gram_anchor.yaml configures it (the float casts left out: float64 here)."""
    target_feats = F.normalize(target_feats, dim=-1)
    target_sim = torch.matmul(target_feats, target_feats.transpose(-1, -2))
    output_feats = F.normalize(output_feats, dim=-1)
    student_sim = torch.matmul(output_feats, output_feats.transpose(-1, -2))
    return torch.nn.MSELoss()(student_sim, target_sim)


def test_equals_dinov3s_gram_loss_with_its_gradient():
    student, teacher = _rand(4, 9, 6, seed=0).requires_grad_(), _rand(4, 9, 6, seed=1)
    mine, theirs = GramAnchoringLoss()(student, teacher), _dinov3_gram_loss(student, teacher)
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(mine, student)[0], torch.autograd.grad(theirs, student)[0],
                               rtol=1e-12, atol=1e-14)


def test_is_the_mean_of_per_image_terms_and_zero_on_the_anchor():
    student, teacher = _rand(6, 5, 4, seed=2), _rand(6, 5, 4, seed=3)
    loss = GramAnchoringLoss()
    per_image = torch.stack([loss(student[b:b + 1], teacher[b:b + 1]) for b in range(6)])
    torch.testing.assert_close(loss(student, teacher), per_image.mean(), rtol=1e-12, atol=1e-14)
    halves = (loss(student[:3], teacher[:3]) + loss(student[3:], teacher[3:])) / 2   # two ranks' local means
    torch.testing.assert_close(loss(student, teacher), halves, rtol=1e-12, atol=1e-14)
    assert float(loss(student, student.clone())) == 0.0


def test_rotations_and_patch_scales_leave_it_unchanged():
    student, teacher = _rand(3, 7, 5, seed=4), _rand(3, 7, 5, seed=5)
    rotation = torch.linalg.qr(_rand(5, 5, seed=6))[0]
    scales = _rand(3, 7, 1, seed=7).abs() + 0.5
    base = GramAnchoringLoss()(student, teacher)
    torch.testing.assert_close(GramAnchoringLoss()(student @ rotation * scales, teacher), base, rtol=1e-10, atol=1e-12)
    g = gram_matrix(student)
    torch.testing.assert_close(torch.diagonal(g, dim1=-2, dim2=-1), torch.ones(3, 7, dtype=torch.float64))


def test_no_gradient_to_the_teacher_and_float32_under_half_inputs():
    student = _rand(2, 4, 3, seed=8).float().requires_grad_()
    teacher = _rand(2, 4, 3, seed=9).float().requires_grad_()
    GramAnchoringLoss()(student, teacher).backward()
    assert student.grad is not None and teacher.grad is None
    half = GramAnchoringLoss()(student.detach().bfloat16(), teacher.detach().bfloat16())
    assert half.dtype == torch.float32


def test_mismatched_features_are_one_line():
    with pytest.raises(ValueError, match=r"one shape \[B, N, D\], got \(2, 4, 3\) and \(2, 5, 3\)"):
        GramAnchoringLoss()(torch.zeros(2, 4, 3), torch.zeros(2, 5, 3))
    with pytest.raises(ValueError, match="one shape"):
        GramAnchoringLoss()(torch.zeros(8, 3), torch.zeros(8, 3))
