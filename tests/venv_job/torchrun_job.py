"""A job as torchrun runs it: RANK/WORLD_SIZE from the environment, gloo, no memgather code."""

import torch
import torch.distributed as dist

import mgtarget

dist.init_process_group("gloo")
slots = mgtarget.gather(torch.full((8,), float(dist.get_rank())))
assert all(torch.equal(s, torch.full((8,), float(r))) for r, s in enumerate(slots))
dist.destroy_process_group()
