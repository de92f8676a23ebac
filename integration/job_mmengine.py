"""mmengine's scenarios for job.py: mmengine.dist, unedited, on 2 gloo ranks.

mmengine 0.10.7 calls ``torch.distributed.all_gather`` from two places these cases reach:

- ``mmengine.dist.all_gather(data)``: ``gather_list = [torch.empty_like(data,
  device=backend_device) ...]`` (fresh slots, each alone on its storage; empty_like
  keeps a non-contiguous input's strides), one ``torch_dist.all_gather(gather_list,
  data_on_device, group)``, then ``return cast_data_device(gather_list, input_device)``:
  on gloo/CPU a new list of the same slot tensors, no copy and no cat. The caller gets
  the slots themselves.
- ``mmengine.dist.all_gather_object(data)`` (so ``collect_results(..., device='gpu')``,
  ``collect_results_gpu`` and ``_collect_results_device``, which call it): on torch
  >= 1.8 it passes ``[None] * world`` to ``torch.distributed.all_gather_object``, whose
  two all_gather calls (sizes into ``unsqueeze`` views of one zeros tensor, then the
  pickled bytes into adjacent views of one ``torch.empty`` buffer) memgather attributes
  to mmengine, past torch.distributed's frames. The views are only read afterwards
  (unpickled); nothing on this path needs CUDA: gloo's object gathers run on CPU.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List

import job
import torch
import torch.distributed as dist


def join() -> None:
    """mmengine's ``init_dist`` needs CUDA (it sets the device for every launcher):
    a CPU job joins torch's group itself, as mmengine's own CPU tests do."""
    dist.init_process_group("gloo")


SAMPLE = 1 << 18  # float32 elements: 1 MiB, one sample's prediction in memory's collect_results


def _results(tensor: torch.Tensor) -> List[Dict[str, Any]]:
    """The tensor as an evaluator's results: one dict per sample, as a DistributedSampler deals
    them, its prediction SAMPLE elements of the tensor. Copies: torch pickles a view's whole storage."""
    return [{"idx": job.RANK + job.WORLD * i, "pred": pred.clone()} for i, pred in enumerate(tensor.split(SAMPLE))]


@job.with_input(_results)
def _collect_results(results: List[Dict[str, Any]]) -> job.Pieces:
    """collect_results(device='gpu'): all_gather_object of the pickled list; the ordered results on rank 0 only.

    memgather gathers the pickled bytes straight into torch's buffer (direct), which lowers
    the peak during the gather (2.5 -> 1.5 x gathered at 96 MiB: the pickled input, the
    buffer, and unpatched gloo's temporary), but not the call's: unpickling every rank's
    bytes (a tobytes() copy each, the pickle's bytes objects held in the unpickler's memo,
    and the tensors made from them, next to the buffer and the input) peaks at about 3.5 x.
    """
    from mmengine.dist import collect_results

    size = job.WORLD * len(results)
    collected = collect_results(results, size, device="gpu")
    if job.RANK != 0:
        assert collected is None, "collect_results returns the results on rank 0 only"
        return {}
    assert [r["idx"] for r in collected] == list(range(size))
    return {rank: [r["pred"] for r in collected[rank::job.WORLD]] for rank in range(job.WORLD)}


def memory_paths() -> Dict[str, Callable[..., job.Pieces]]:
    """job.memory's paths: mmengine.dist.all_gather (its slots, as a list), and collect_results."""
    from mmengine.dist import all_gather

    return {"dist.all_gather": lambda tensor: job.list_pieces(all_gather(tensor)),
            "collect_results(device='gpu')": _collect_results}


def _plain(value: Any) -> torch.Tensor:
    """The non-tensor part of a gathered structure, as bytes job.py's digest records."""
    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return f"<tensor {obj.dtype} {list(obj.shape)}>"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, default=default, sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (job.data has NaN in it, which torch.equal calls unequal to itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _prediction(index: int) -> torch.Tensor:
    """Sample ``index``'s prediction, the same on every rank: 640 KiB of float32."""
    generator = torch.Generator().manual_seed(5000 + index)
    return torch.randn(163840, generator=generator)


def cases() -> Dict[str, Any]:
    from mmengine.dist import all_gather, all_gather_object, collect_results, collect_results_gpu, get_dist_info

    join()
    assert get_dist_info() == (job.RANK, job.WORLD) and dist.get_backend() == "gloo", "not a 2-rank gloo job"
    out: Dict[str, Any] = {}

    big = job.data(job.BIG // 64, 64, 40)  # 3 MiB per rank
    gathered = all_gather(big)
    assert type(gathered) is list and len(gathered) == job.WORLD and _same(gathered[job.RANK], big)
    out["all_gather_big"] = gathered
    out["all_gather_small"] = all_gather(torch.arange(5) + 10 * job.RANK)
    # A transposed input: empty_like keeps its strides, so the slots are not contiguous either.
    transposed = job.data(64, job.BIG // 64, 41).t()
    slots = all_gather(transposed)
    assert not any(slot.is_contiguous() for slot in slots) and _same(slots[job.RANK], transposed)
    out["all_gather_transposed"] = slots

    mine = {"rank": job.RANK, "name": f"rank-{job.RANK}", "scores": [0.25 * job.RANK, -1.5, float("inf")],
            "tensor": job.data(4, 3, 42)}
    objects = all_gather_object(mine)
    assert [o["rank"] for o in objects] == list(range(job.WORLD)), objects
    out["all_gather_object"] = {"objects": objects, "plain": _plain(objects)}

    # An evaluator's results, as a DistributedSampler deals them: 9 samples over 2 ranks,
    # the last one padded with sample 0; 5 predictions of 640 KiB each per rank.
    dealt = (list(range(9)) + [0])[job.RANK::job.WORLD]
    results = [{"idx": i, "pred": _prediction(i)} for i in dealt]
    collected = collect_results(results, 9, device="gpu")
    if job.RANK == 0:
        assert collected is not None and [r["idx"] for r in collected] == list(range(9)), collected
        assert all(torch.equal(r["pred"], _prediction(r["idx"])) for r in collected)
    else:
        assert collected is None, "collect_results returns the results on rank 0 only"
    out["collect_results_gpu_path"] = {"results": collected, "plain": _plain(collected)}

    names: List[str] = [f"sample-{i}" for i in dealt]
    collected_names = collect_results_gpu(names, 9)
    if job.RANK == 0:
        assert collected_names == [f"sample-{i}" for i in range(9)], collected_names
    out["collect_results_gpu"] = _plain(collected_names)
    return out
