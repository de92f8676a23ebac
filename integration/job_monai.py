"""MONAI's scenarios for job.py: monai.utils.dist and its cumulative metrics, unedited, on 2 gloo ranks.

monai 1.6.1 gathers tensors in one function, ``monai.utils.dist.evenly_divisible_all_gather``
(used by ``Cumulative.get_buffer`` / ``CumulativeIterationMetric.aggregate`` through
``_sync``, by ``string_list_all_gather`` and by its handlers). It takes one of two paths:

- Ignite installed: ``idist.all_gather`` of the lengths, then of the data padded to the
  longest rank (Ignite's ``_do_all_gather``: zeros_like slots and a cat that memgather
  elides), then slices of that result, or their ``torch.cat`` with ``concat=True``.
- Otherwise its ``_torch_all_gather``: ``all_lens = [torch.zeros_like(length_tensor) ...]``
  gathered (a few bytes: left to torch), the data padded to the longest rank, ``output =
  [torch.zeros_like(data) ...]`` gathered, then ``[o[:l, ...] for o, l in zip(output,
  all_lens_)]``: slices of the slots, returned as a list, or their ``torch.cat``.
  The slices are not a cat of the whole list, so memgather fills the slots where they
  lie (gloo's temporary saved), and the ``concat=True`` cat is a copy, as under torch.

The tox environment ``monai`` runs these without Ignite, ``monai-ignite`` with it;
``PATH`` says which one this is.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import job
import torch
import torch.distributed as dist

ROW = 1024  # elements of a Cumulative buffer's item


def join() -> None:
    """MONAI has no launcher of its own: its users (and its tests) join torch's group."""
    dist.init_process_group("gloo")


def path() -> str:
    """Which of evenly_divisible_all_gather's two paths this environment takes."""
    from monai.utils import dist as monai_dist

    return "ignite" if monai_dist.has_ignite else "torch"


@job.uneven
def _list(tensor: torch.Tensor) -> job.Pieces:
    from monai.utils import evenly_divisible_all_gather

    return dict(enumerate(evenly_divisible_all_gather(tensor, concat=False)))


@job.uneven
def _concat(tensor: torch.Tensor) -> job.Pieces:
    from monai.utils import evenly_divisible_all_gather

    return job.uneven_pieces(evenly_divisible_all_gather(tensor, concat=True))


def _cumulative(tensor: torch.Tensor) -> Any:
    """A Cumulative buffer that has seen ``tensor`` as rows of ROW elements (views of it, as extend keeps them)."""
    from monai.metrics import Cumulative

    buffer = Cumulative()
    buffer.extend(tensor.view(-1, ROW))
    return buffer


@job.uneven
@job.with_input(_cumulative)
def _get_buffer(buffer: Any) -> job.Pieces:
    """Cumulative.get_buffer(): the items stacked, then evenly_divisible_all_gather(concat=True)."""
    return job.uneven_pieces(buffer.get_buffer())


def memory_paths() -> Dict[str, Callable[..., job.Pieces]]:
    """job.memory's paths, each with uneven lengths across ranks."""
    return {"evenly_divisible_all_gather(concat=False)": _list,
            "evenly_divisible_all_gather(concat=True)": _concat,
            "Cumulative.get_buffer": _get_buffer}


def cases() -> Dict[str, Any]:
    from monai.metrics import Cumulative, ROCAUCMetric
    from monai.utils import evenly_divisible_all_gather, string_list_all_gather

    join()
    assert dist.get_world_size() == job.WORLD and dist.get_backend() == "gloo", "not a 2-rank gloo job"
    out: Dict[str, Any] = {"path": torch.tensor([path() == "ignite"])}
    rows = job.BIG // 64 - 700 * job.RANK  # uneven: rank 1 is padded to rank 0's length before the gather
    uneven = job.data(rows, 64, 60)
    gathered = evenly_divisible_all_gather(uneven, concat=False)
    assert [len(piece) for piece in gathered] == [job.BIG // 64 - 700 * rank for rank in range(job.WORLD)]
    out["uneven_list"] = gathered
    out["uneven_concat"] = evenly_divisible_all_gather(uneven, concat=True)
    out["even_concat"] = evenly_divisible_all_gather(job.data(job.BIG // 64, 64, 61), concat=True)
    out["float16_list"] = evenly_divisible_all_gather(job.data(job.BIG // 32, 32, 62, torch.float16), concat=False)
    out["0d_list"] = evenly_divisible_all_gather(torch.tensor(1.5 * job.RANK), concat=False)
    strings = string_list_all_gather([f"case-{job.RANK}-{i}" for i in range(3 + job.RANK)])
    assert strings == [f"case-{rank}-{i}" for rank in range(job.WORLD) for i in range(3 + rank)], strings
    out["strings"] = torch.tensor(list("\t".join(strings).encode()), dtype=torch.uint8)

    buffer = Cumulative()  # two buffers, items of different shapes, extended in batches
    generator = torch.Generator().manual_seed(63 + job.RANK)
    for _ in range(4):
        buffer.extend(torch.randn(job.BIG // ROW // 4, ROW, generator=generator),
                      torch.arange(job.BIG // ROW // 4) + job.RANK)
    out["cumulative_get_buffer"] = buffer.get_buffer()

    # ROCAUCMetric, a CumulativeIterationMetric: aggregate() gathers its buffers (uneven batches).
    metric = ROCAUCMetric()
    for _ in range(3 + job.RANK):
        scores = torch.rand(job.BIG // 64, generator=generator)
        metric(y_pred=scores, y=(torch.rand(job.BIG // 64, generator=generator) < scores).long())
    out["roc_auc_aggregate"] = torch.tensor(metric.aggregate(), dtype=torch.float64)
    return out
