"""PyTorch-Ignite's scenarios for job.py: ignite.distributed and its epoch metrics, unedited, on 2 gloo ranks.

pytorch-ignite 0.5.5 calls ``torch.distributed.all_gather`` from two places:

- ``_NativeDistModel._do_all_gather`` (``ignite/distributed/comp_models/native.py``):
  ``output = [torch.zeros_like(tensor) ...]``, ``dist.all_gather(output, tensor)`` in
  either branch of an ``if`` (with or without ``group=``), ``return torch.cat(output,
  dim=0)``. Every tensor gather in Ignite ends here: ``idist.all_gather`` (tensors,
  numbers and strings), ``idist.all_gather_tensors_with_shapes``, and ``EpochMetric.compute``
  (``ROC_AUC``, ``AveragePrecision``, ``PrecisionRecallCurve``, ``CohenKappa``, ...), which
  concatenates an epoch's predictions and targets and gathers each. The elision proof
  accepts this function, so its cat returns the gathered buffer.
- ``_NativeDistModel._get_all_hostnames``, when a job starts without ``LOCAL_RANK``
  (torchrun sets it, so these cases do not reach it): 2 KiB per rank, left to torch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import job
import torch


def join() -> None:
    """Ignite's own way: ``idist.initialize`` reads torchrun's environment."""
    import ignite.distributed as idist

    idist.initialize("gloo")


def _epoch_metric(compute_fn: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
    from ignite.metrics import EpochMetric

    return EpochMetric(compute_fn, check_compute_fn=False)


def _updated(predictions: torch.Tensor) -> Any:
    """An EpochMetric that has seen ``predictions`` in 4 batches, with 0/1 uint8 targets of the
    same length (as ROC_AUC's are); its compute_fn keeps what compute() gathered (rank 0 runs it)."""
    kept: Dict[str, torch.Tensor] = {}

    def keep(y_pred: torch.Tensor, y: torch.Tensor) -> float:
        kept["y_pred"] = y_pred
        return 0.0

    metric = _epoch_metric(keep)
    for batch in predictions.chunk(4):
        metric.update((batch, (batch > 0.5).to(torch.uint8)))
    metric.kept = kept
    return metric


@job.with_input(_updated)
def _epoch_metric_compute(metric: Any) -> job.Pieces:
    """EpochMetric.compute(): the epoch's predictions and targets concatenated and gathered;
    the gathered predictions, which compute_fn sees on rank 0 only."""
    metric.compute()
    if job.RANK != 0:
        return {}
    return job.flat_pieces(metric.kept.pop("y_pred"))


def memory_paths() -> Dict[str, Callable[..., job.Pieces]]:
    """job.memory's paths: idist.all_gather, and an EpochMetric's compute()."""
    import ignite.distributed as idist

    return {"idist.all_gather": lambda tensor: job.flat_pieces(idist.all_gather(tensor)),
            "EpochMetric.compute": _epoch_metric_compute}


def _roc_auc(seed: int) -> Dict[str, Any]:
    """ROC_AUC (scikit-learn's roc_auc_score on rank 0, broadcast): 3 MiB of scores per rank."""
    from ignite.metrics import ROC_AUC

    generator = torch.Generator().manual_seed(1000 * seed + job.RANK)
    scores = torch.rand(job.BIG, generator=generator)
    labels = (torch.rand(job.BIG, generator=generator) < scores).long()
    metric = ROC_AUC()
    for batch, batch_labels in zip(scores.chunk(3), labels.chunk(3)):
        metric.update((batch, batch_labels))
    return {"roc_auc": torch.tensor(metric.compute(), dtype=torch.float64)}


def cases() -> Dict[str, Any]:
    import ignite.distributed as idist

    join()
    assert (idist.get_rank(), idist.get_world_size(), idist.backend()) == (job.RANK, job.WORLD, "gloo"), \
        "not a 2-rank gloo job"
    out: Dict[str, Any] = {}
    out["all_gather_big"] = idist.all_gather(job.data(job.BIG // 64, 64, 50))
    out["all_gather_bfloat16"] = idist.all_gather(job.data(job.BIG // 64, 64, 51, torch.bfloat16))
    # zeros_like keeps a transposed input's strides: slots that are not contiguous stay with torch.
    out["all_gather_transposed"] = idist.all_gather(job.data(64, job.BIG // 64, 52).t())
    out["all_gather_0d"] = idist.all_gather(torch.tensor(2.5 + job.RANK))
    out["all_gather_small"] = idist.all_gather(torch.arange(7) + 10 * job.RANK)
    # The other branch of _do_all_gather's if: a group given.
    group = idist.new_group(list(range(job.WORLD)))
    out["all_gather_group"] = idist.all_gather(job.data(job.BIG // 32, 32, 53), group=group)
    numbers: List[float] = idist.all_gather(0.5 * job.RANK - 1.0)
    strings: List[str] = idist.all_gather(f"rank-{job.RANK}")
    out["all_gather_number_and_string"] = torch.tensor(list(map(float, numbers)) + [len(s) for s in strings])
    assert strings == [f"rank-{rank}" for rank in range(job.WORLD)], strings
    shapes = [[job.BIG // 64 - 100 * rank, 64] for rank in range(job.WORLD)]
    mine = job.data(*shapes[job.RANK], 54)
    with_shapes = idist.all_gather_tensors_with_shapes(mine, shapes)
    assert torch.equal(with_shapes[job.RANK].nan_to_num(), mine.nan_to_num())
    out["all_gather_tensors_with_shapes"] = with_shapes

    # EpochMetric over an epoch of 5 batches per rank, its compute_fn in torch.
    def weighted(y_pred: torch.Tensor, y: torch.Tensor) -> float:
        return float((y_pred.double() * (y.double() * 2 - 1)).sum())

    metric = _epoch_metric(weighted)
    generator = torch.Generator().manual_seed(55 + job.RANK)
    for _ in range(5):
        y_pred = torch.rand(job.BIG // 5, generator=generator)
        metric.update((y_pred, (y_pred > 0.3).long()))
    out["epoch_metric"] = torch.tensor(metric.compute(), dtype=torch.float64)
    out.update(_roc_auc(56))
    return out
