"""Lightly SSL's model of MMCR, W-MSE, SMoG and EMP-SSL for `unison bench lightly`, the methods whose loss is a
statistic of the batch: heads, loss and training step around the shared backbone, from Lightly's modules only.

As `benchmarks.lab.lightly_models` (its `Side`): which Lightly example, benchmark or pieces each follows, and the recipe
and transform that go with it, are in `benchmarks.lab.lightly_methods`. Lightly (and scikit-learn, for SMoG's k-means)
is imported inside the methods, so this module imports without it.

Example::

    model = MMCRSide(backbone, 512)
    loss = model.training_loss(views, step, total_steps)   # views: the method's Lightly transform, batched
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .lightly_models import Side, lightly_momentum_copy


class MMCRSide(Side):
    """Lightly's MMCR example: online and momentum networks, every view through both, ``MMCRLoss`` on their
    [n, views, d] outputs; the momentum follows its cosine schedule from 0.996 to 1 (per step here)."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import MMCRLoss
        from lightly.models.modules import MMCRProjectionHead

        super().__init__(backbone)
        self.projection_head = MMCRProjectionHead(dim, 512, 128)
        self.backbone_momentum = lightly_momentum_copy(self.backbone)
        self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        self.criterion = MMCRLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum
        from lightly.utils.scheduler import cosine_schedule

        momentum = cosine_schedule(step, steps, 0.996, 1)
        update_momentum(self.backbone, self.backbone_momentum, m=momentum)
        update_momentum(self.projection_head, self.projection_head_momentum, m=momentum)
        online = torch.stack([self.projection_head(self.features(x)) for x in views], dim=1)
        target = torch.stack([self.projection_head_momentum(self.backbone_momentum(x).flatten(start_dim=1)).detach()
                              for x in views], dim=1)
        return self.criterion(online, target)


class WMSESide(Side):
    """Lightly's ``WMSELoss`` on the official W-MSE head (Linear 1024, BN, ReLU, Linear 64) over both views."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import WMSELoss
        from lightly.models.modules.heads import ProjectionHead

        super().__init__(backbone)
        self.projection_head = ProjectionHead([(dim, 1024, nn.BatchNorm1d(1024), nn.ReLU(inplace=True)),
                                               (1024, 64, None, None)])
        self.criterion = WMSELoss(embedding_dim=64, w_size=128, num_samples=2)

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        return self.criterion(self.projection_head(torch.cat([self.features(v) for v in views])))


class SMoGSide(Side):
    """The SMoG model of Lightly's CIFAR-10 benchmark: the views swap every other step, the groups are reset from the
    memory bank by k-means every 300 steps (the momentum network copied from the online one), otherwise EMA 0.99."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules.heads import SMoGPredictionHead, SMoGProjectionHead, SMoGPrototypes
        from lightly.models.modules.memory_bank import MemoryBankModule

        super().__init__(backbone)
        self.projection_head = SMoGProjectionHead(dim, 2048, 128)
        self.prediction_head = SMoGPredictionHead(128, 2048, 128)
        self.backbone_momentum = lightly_momentum_copy(self.backbone)
        self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        self.n_groups = 300
        self.smog = SMoGPrototypes(group_features=nn.functional.normalize(torch.rand(self.n_groups, 128), dim=1),
                                   beta=0.99)
        self.memory_bank = MemoryBankModule(size=(10000, 128))
        self.criterion = nn.CrossEntropyLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models.utils import update_momentum
        from sklearn.cluster import KMeans

        if step > 0 and step % 300 == 0:   # reset the group features and the momentum network
            centres = KMeans(self.n_groups).fit(self.memory_bank.bank.cpu().numpy()).cluster_centers_
            self.smog.set_group_features(nn.functional.normalize(torch.from_numpy(centres).float(), dim=1)
                                         .to(self.memory_bank.bank.device))
            self.backbone_momentum = lightly_momentum_copy(self.backbone)
            self.projection_head_momentum = lightly_momentum_copy(self.projection_head)
        else:
            update_momentum(self.backbone, self.backbone_momentum, 0.99)
            update_momentum(self.projection_head, self.projection_head_momentum, 0.99)
        x0, x1 = views if step % 2 == 0 else views[::-1]
        x0_encoded = self.projection_head(self.features(x0))
        x0_predicted = self.prediction_head(x0_encoded)
        x1_encoded = self.projection_head_momentum(self.backbone_momentum(x1).flatten(start_dim=1))
        assignments = self.smog.assign_groups(x1_encoded)
        group_features = self.smog.get_updated_group_features(x0_encoded)
        logits = self.smog(x0_predicted, group_features, temperature=0.1)
        self.smog.set_group_features(group_features)
        self.memory_bank(x0_encoded, update=True)
        return self.criterion(logits, assignments)


class EMPSSLSide(Side):
    """EMP-SSL from Lightly's loss functions and modules, as the official code trains it: every patch through the
    network, a 4096-4096-1024 head, L2-normalised, -TCR + 200 x invariance (``tcr_loss`` with the paper's sign)."""

    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.models.modules.heads import ProjectionHead

        super().__init__(backbone)
        self.projection_head = ProjectionHead([(dim, 4096, nn.BatchNorm1d(4096), nn.ReLU(inplace=True)),
                                               (4096, 4096, nn.BatchNorm1d(4096), nn.ReLU(inplace=True)),
                                               (4096, 1024, None, None)])

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.loss.emp_ssl_loss import invariance_loss, tcr_loss

        z = nn.functional.normalize(self.projection_head(self.features(torch.cat(views))), dim=1)
        z = z.reshape(len(views), views[0].shape[0], -1)
        return -tcr_loss(z, eps=0.2) + 200.0 * invariance_loss(z)
