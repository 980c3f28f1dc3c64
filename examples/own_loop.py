"""unison's losses in your own DDP loop: exact at any number of processes (README, "Your own loop").

    torchrun --nproc-per-node 2 examples/own_loop.py      # 2 processes, 64 images each
    python examples/own_loop.py                           # 1 process, the same 128: the same losses

Inside a process group `unison.losses.NTXentLoss` gathers every rank's embeddings (with their gradients), so each
rank's loss is its share of the global-batch loss and DDP's gradient average is the global-batch gradient. Two
things stay yours: give each rank its own slice of every global batch, and use SyncBatchNorm where the model has
batch norm (here: none).
"""

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from unison.losses import NTXentLoss

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--global-batch", type=int, default=128)
parser.add_argument("--out", default=None, help="write the losses (rank 0) to this JSON file")
args = parser.parse_args()

distributed = "WORLD_SIZE" in os.environ   # started by torchrun (or srun/mpirun with its variables)
if distributed:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
torch.manual_seed(0)                                     # the same initial model on every rank
torch.set_default_dtype(torch.float64)                   # to compare 1 and W processes to rounding level
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 32))
net = DDP(model) if distributed else model
loss_fn = NTXentLoss(temperature=0.5)                    # gathers over the process group by default
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1)
losses = []
for _ in range(args.steps):
    views = torch.rand(2, args.global_batch, 3, 8, 8, generator=data)   # the global batch, the same on every rank
    mine = slice(rank * args.global_batch // world, (rank + 1) * args.global_batch // world)
    loss = loss_fn(net(views[0, mine]), net(views[1, mine]))   # this rank's share of the global-batch loss
    optimizer.zero_grad()
    loss.backward()                                      # DDP averages: the global batch's gradient
    optimizer.step()
    total = loss.detach().clone()
    if distributed:
        dist.all_reduce(total)
        total /= world
    losses.append(total.item())
if rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump(losses, f)
if distributed:
    # DDP holds the process group: free it while the interpreter is whole. Left to the interpreter's exit, gloo's
    # teardown aborts the process now and then ("terminate called without an active exception", SIGABRT).
    del net
    gc.collect()
    dist.destroy_process_group()
