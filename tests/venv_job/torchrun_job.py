"""A job as torchrun runs it: RANK/WORLD_SIZE from the environment, gloo, no memgather code."""

import mgtarget
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
slots = mgtarget.gather(torch.full((1 << 20,), float(dist.get_rank())))  # 4 MiB: rewired on gloo
assert all(torch.equal(s, torch.full((1 << 20,), float(r))) for r, s in enumerate(slots))
dist.destroy_process_group()
