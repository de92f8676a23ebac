"""memgather: one flat buffer for torch.distributed.all_gather.

Public API::

    memgather.all_gather(tensor_list, tensor, group=None, async_op=False)
    memgather.gather(tensor, group=None) -> Tensor
    memgather.stats() / memgather.reset_stats()
    memgather.primitive()  # which single-tensor all-gather this torch offers, and why
    memgather.UnevenShapesError
"""

from memgather.compat import Primitive
from memgather.compat import single_tensor_primitive as primitive
from memgather.core import all_gather, gather
from memgather.errors import UnevenShapesError
from memgather.stats import Stats, reset_stats, stats
from memgather.strategies import Reason, Strategy

__all__ = [
    "Primitive",
    "Reason",
    "Stats",
    "Strategy",
    "UnevenShapesError",
    "all_gather",
    "gather",
    "primitive",
    "reset_stats",
    "stats",
]

__version__ = "0.1.0"
