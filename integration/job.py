"""One rank of an integration job, started by torchrun: real library code, unedited.

``python -m torch.distributed.run --standalone --nproc_per_node 2 job.py LIBRARY OUT_DIR``
runs LIBRARY's scenarios and writes ``OUT_DIR/rank<R>.json``: for every case, the
dtype, shape and SHA-256 of each tensor the library returned, in order. Nothing
here mentions memgather: the launcher's environment (``MEMGATHER=1`` through
memgather's ``.pth``) decides whether it is on, exactly as for a user's job.
``LIBRARY-memory`` instead measures the peak resident-set growth of one gather
of ``MEMGATHER_JOB_MIB`` MiB per rank through one of LIBRARY's call paths,
``MEMGATHER_JOB_PATH`` (``memory``, ``memory_paths``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BIG = 3 << 18  # float32 elements: 3 MiB per rank, above gloo's 2 MiB rewiring threshold


def data(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic per-rank data with negative zeros, NaN and infinities in it."""
    generator = torch.Generator().manual_seed(1000 * seed + RANK)
    tensor = torch.randn(rows, cols, generator=generator) * 100
    tensor.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    return tensor.to(dtype)


def leaves(value: Any) -> List[torch.Tensor]:
    """Every tensor in a nested structure, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in leaves(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in leaves(item)]
    return []


def digest(value: Any) -> List[List[Any]]:
    out = []
    for tensor in leaves(value):
        flat = tensor.detach().contiguous().cpu().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        out.append([str(tensor.dtype), list(tensor.shape), hashlib.sha256(raw).hexdigest()])
    return out


# --- accelerate: utils.gather on nested structures, and Accelerator.gather_for_metrics ---

def accelerate_cases() -> Dict[str, Any]:
    from accelerate.utils import gather
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = _join("accelerate")
    assert accelerator.num_processes == WORLD and dist.get_backend() == "gloo", "not a 2-rank gloo job"
    big = data(BIG // 64, 64, 1)
    cases = {
        "gather_big": gather(big),
        "gather_nested": gather({
            "logits": data(BIG // 128, 128, 2),
            "labels": torch.arange(6) + 10 * RANK,
            "pair": [big.t(), torch.tensor(float(RANK))],  # non-contiguous, and 0-d
            "half": (data(BIG // 64, 64, 3, torch.bfloat16),),
        }),
    }
    # 9 samples over 2 ranks in batches of 2: the last batch is padded with repeats,
    # which gather_for_metrics drops again. Each sample is 1.25 MiB of features.
    features = torch.arange(9 * 327680, dtype=torch.float32).reshape(9, 327680)
    loader = accelerator.prepare(DataLoader(TensorDataset(features, torch.arange(9)), batch_size=2))
    gathered = [accelerator.gather_for_metrics((x * 2 + 1, y)) for x, y in loader]
    rows = sum(len(labels) for _, labels in gathered)
    assert rows == 9, f"gather_for_metrics returned {rows} rows of 9"  # the padding was dropped
    cases["gather_for_metrics"] = gathered
    return cases


# --- memory: one big gather through each of a library's call paths (``LIBRARY-memory``) ---

Pieces = Dict[int, Union[torch.Tensor, List[torch.Tensor]]]


def memory_input(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input to ``memory``'s gather: any rank can make it again, to check a gathered piece."""
    return torch.rand(numel, generator=torch.Generator().manual_seed(7000 + rank))


def flat_pieces(result: torch.Tensor, ranks: Optional[List[int]] = None) -> Pieces:
    """The pieces of a concatenated result, by the rank each came from (``ranks``, in the result's order)."""
    ranks = list(range(WORLD)) if ranks is None else ranks
    return dict(zip(ranks, result.detach().reshape(-1).chunk(len(ranks))))


def list_pieces(slots: Any) -> Pieces:
    """The pieces of a list of slots (or of a stacked tensor's rows), slot ``r`` rank ``r``'s."""
    return {rank: slot.detach().reshape(-1) for rank, slot in enumerate(slots)}


def with_input(prepare: Callable[[torch.Tensor], Any]) -> Callable[[Callable[..., Pieces]], Callable[..., Pieces]]:
    """Marks a path whose library call takes ``prepare(tensor)`` rather than the tensor: ``memory``
    makes it before the measurement, so it is not counted (as the tensor is not)."""
    def mark(gather: Callable[..., Pieces]) -> Callable[..., Pieces]:
        gather.prepare = prepare  # type: ignore[attr-defined]
        return gather
    return mark


def uneven(gather: Callable[..., Pieces]) -> Callable[..., Pieces]:
    """Marks a path whose ranks gather different lengths: rank ``r`` passes the first
    ``numel - r * (numel // 8)`` elements of its input (``trimmed``), and its piece is checked
    against them. The gathered size ``memory`` reports stays the longest rank's times the world."""
    gather.trimmed = True  # type: ignore[attr-defined]
    return gather


def trimmed(rank: int, tensor: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s share of ``tensor`` on an ``uneven`` path: rank 0 the whole, each later rank an eighth less."""
    return tensor[:tensor.numel() - rank * (tensor.numel() // 8)]


def uneven_pieces(result: torch.Tensor) -> Pieces:
    """The pieces of the concatenation of every rank's ``trimmed`` share, by rank: the lengths follow
    from the total (rank 0's length ``n`` is a multiple of 8; rank ``r`` has ``n - r * n // 8``)."""
    flat = result.detach().reshape(-1)
    first = flat.numel() * 16 // (16 * WORLD - WORLD * (WORLD - 1))
    lengths = [first - rank * (first // 8) for rank in range(WORLD)]
    assert sum(lengths) == flat.numel(), (lengths, flat.numel())
    return dict(enumerate(flat.split(lengths)))


SAMPLE = 1 << 18  # float32 elements: 1 MiB, one sample's prediction in the evaluation results below


def eval_results(tensor: torch.Tensor) -> List[Dict[str, Any]]:
    """The tensor as an evaluator's results: one dict per sample, its prediction SAMPLE elements of the
    tensor. Copies: torch pickles a view's whole storage."""
    return [{"idx": RANK + WORLD * i, "pred": pred.clone()} for i, pred in enumerate(tensor.split(SAMPLE))]


def memory_paths(library: str) -> Dict[str, Callable[..., Pieces]]:
    """LIBRARY's call paths for ``memory``, by the name docs/libraries.md gives each, its default first.

    Each gathers its argument (this rank's tensor) through the library's own code, unedited,
    and returns the pieces of the gathered result that the library hands this rank, by
    the rank each came from: this rank's own among them wherever the library returns it.
    A library whose scenarios live in ``job_<library>.py`` has its ``memory_paths()`` there.
    """
    if library == "accelerate":
        from accelerate.utils import gather, gather_object

        @with_input(eval_results)
        def objects(results: List[Dict[str, Any]]) -> Pieces:
            """gather_object: every rank's results (torch's all_gather_object), flattened in rank order."""
            gathered = gather_object(results)
            each = len(results)
            return {rank: [r["pred"] for r in gathered[rank * each:(rank + 1) * each]] for rank in range(WORLD)}

        @with_input(eval_results)
        def for_metrics(results: List[Dict[str, Any]]) -> Pieces:
            """Trainer's evaluation with eval_use_gather_object: gather_for_metrics(use_gather_object=True)."""
            from accelerate import Accelerator

            gathered = Accelerator(cpu=True).gather_for_metrics(results, use_gather_object=True)
            each = len(results)
            return {rank: [r["pred"] for r in gathered[rank * each:(rank + 1) * each]] for rank in range(WORLD)}

        return {"utils.gather": lambda tensor: flat_pieces(gather(tensor)), "utils.gather_object": objects,
                "gather_for_metrics(use_gather_object=True)": for_metrics}
    if library == "transformers":
        from transformers.trainer_pt_utils import distributed_concat

        return {"distributed_concat": lambda tensor: flat_pieces(distributed_concat(tensor))}
    if library == "torchmetrics":
        from torchmetrics.utilities.distributed import gather_all_tensors

        return {"gather_all_tensors": lambda tensor: list_pieces(gather_all_tensors(tensor)),
                "CatMetric.compute": _cat_metric_compute, "tensor state: Metric.compute": _tensor_state_compute,
                "BinaryAUROC.compute": _auroc_compute}
    if library == "deepspeed":
        import deepspeed.comm as ds_comm

        def fresh_slots(tensor: torch.Tensor) -> Pieces:
            slots = [torch.empty_like(tensor) for _ in range(WORLD)]
            ds_comm.all_gather(slots, tensor)
            return list_pieces(slots)

        return {"comm.all_gather": fresh_slots}
    if library == "open_clip":
        from open_clip.loss import gather_features

        def features(with_grad: bool) -> Callable[[torch.Tensor], Pieces]:
            def gather(tensor: torch.Tensor) -> Pieces:
                # The tensor is both the image and the text features (not requiring grad): both are
                # gathered and concatenated; the pieces are the image features'.
                image, _ = gather_features(tensor, tensor, gather_with_grad=with_grad, rank=RANK, world_size=WORLD)
                return flat_pieces(image)
            return gather

        return {"gather_features": features(False), "gather_features(gather_with_grad=True)": features(True)}
    if library == "pytorch_metric_learning":
        from pytorch_metric_learning.utils.distributed import all_gather as pml_all_gather

        # It pops this rank's slot before its torch.cat: the result is the other ranks' rows, in rank order.
        others = [rank for rank in range(WORLD) if rank != RANK]
        return {"utils.distributed.all_gather": lambda tensor: flat_pieces(pml_all_gather(tensor), others)}
    return own_module(library).memory_paths()


def _join(library: str) -> Any:
    """Join the job's process group as LIBRARY's users do; accelerate's Accelerator is returned."""
    if library == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True)
    if library == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif library in SCENARIOS:
        dist.init_process_group("gloo")
    else:
        own_module(library).join()
    return None


def memory(library: str) -> Dict[str, Any]:
    """Peak RSS growth of one gather of MEMGATHER_JOB_MIB MiB per rank through LIBRARY's call path
    MEMGATHER_JOB_PATH (``memory_paths``; its first by default), the input not counted.

    Every piece of the result the path hands this rank is then checked against the input of
    the rank it came from ("checked": those ranks); "paths" names all of LIBRARY's paths.
    """
    from memgather.tools import rss  # only to read the high-water mark: the gather is the library's own

    _join(library)
    paths = memory_paths(library)
    name = os.environ.get("MEMGATHER_JOB_PATH") or next(iter(paths))
    if name not in paths:
        raise SystemExit(f"{library} has no memory path {name!r}: {', '.join(paths)}")
    gather = paths[name]
    prepare: Callable[[torch.Tensor], Any] = getattr(gather, "prepare", lambda tensor: tensor)

    def share(rank: int, numel: int) -> torch.Tensor:
        tensor = memory_input(rank, numel)
        return trimmed(rank, tensor) if getattr(gather, "trimmed", False) else tensor

    numel = int(os.environ.get("MEMGATHER_JOB_MIB", "196")) << 18
    argument = prepare(share(RANK, numel))
    gather(prepare(share(RANK, 1 << 18)))  # first-call costs are not the gather's
    dist.barrier()
    rss.reset_peak()
    before = rss.current_bytes()
    pieces = gather(argument)
    growth = rss.peak_bytes() - before
    correct = all(torch.equal(torch.cat(piece) if isinstance(piece, list) else piece, share(rank, numel))
                  for rank, piece in pieces.items())
    return {"path": name, "paths": list(paths), "growth": growth, "gathered": numel * 4 * WORLD,
            "correct": correct, "checked": sorted(pieces)}


# --- transformers: trainer_pt_utils.distributed_concat, nested as the Trainer uses it ---

def transformers_cases() -> Dict[str, Any]:
    from transformers.trainer_pt_utils import distributed_concat

    _join("transformers")
    logits, labels = data(BIG // 256, 256, 4), torch.arange(BIG // 256) + 7 * RANK
    return {
        "tensor": distributed_concat(data(BIG // 64, 64, 5)),
        "tuple_truncated": distributed_concat((logits, labels), num_total_examples=2 * (BIG // 256) - 5),
        "dict_nested": distributed_concat({"hidden": [data(BIG // 32, 32, 6), data(3, 5, 7)],
                                           "loss": torch.tensor(1.5 + RANK)}),
        "float16": distributed_concat(data(BIG // 64, 64, 8, torch.float16)),
    }


# --- torchmetrics: metrics with tensor states, synced across ranks in compute() ---

def torchmetrics_cases() -> Dict[str, Any]:
    import torchmetrics
    from torchmetrics.aggregation import CatMetric, SumMetric

    _join("torchmetrics")
    out = {}
    cat = CatMetric()  # a list state; uneven lengths per rank are padded, gathered and trimmed
    cat.update(data(BIG // 8 - 1000 * RANK, 8, 9).reshape(-1))
    out["cat_uneven"] = cat.compute()
    even = CatMetric()
    even.update(data(BIG // 8, 8, 10).reshape(-1))
    out["cat_even"] = even.compute()
    mse = torchmetrics.MeanSquaredError()
    mse.update(data(BIG // 16, 16, 11).nan_to_num(), data(BIG // 16, 16, 12).nan_to_num())
    out["mse"] = mse.compute()
    total = SumMetric()
    total.update(torch.arange(5.0) * (RANK + 1))
    out["sum"] = total.compute()
    return out


def _cat_metric(tensor: torch.Tensor) -> Any:
    from torchmetrics.aggregation import CatMetric

    metric = CatMetric()
    metric.update(tensor)
    return metric


@with_input(_cat_metric)
def _cat_metric_compute(metric: Any) -> Pieces:
    """CatMetric.compute(): its list state synced (gather_all_tensors, then dim_zero_cat) and returned."""
    return flat_pieces(metric.compute())


def _tensor_state(tensor: torch.Tensor) -> Any:
    from torchmetrics import Metric

    class Collected(Metric):
        """A tensor state of its own (as a custom metric keeps a histogram or a buffer of scores),
        synced by torch.stack of the gathered states (dist_reduce_fx=None) and returned as it is."""

        def __init__(self, size: int) -> None:
            super().__init__()
            self.add_state("values", default=torch.zeros(size), dist_reduce_fx=None)

        def update(self, values: torch.Tensor) -> None:
            self.values += values

        def compute(self) -> torch.Tensor:
            return self.values

    metric = Collected(tensor.numel())
    metric.update(tensor)
    return metric


@with_input(_tensor_state)
def _tensor_state_compute(metric: Any) -> Pieces:
    return list_pieces(metric.compute())


def _auroc(tensor: torch.Tensor) -> Any:
    from torchmetrics.classification import BinaryAUROC
    from torchmetrics.utilities import dim_zero_cat

    class KeptAUROC(BinaryAUROC):
        """BinaryAUROC (exact: thresholds=None, list states), keeping the synced scores it computed on."""

        def compute(self) -> torch.Tensor:
            self.kept = dim_zero_cat(self.preds)
            return super().compute()

    metric = KeptAUROC()
    metric.update(tensor, (tensor > 0.5).to(torch.uint8))
    return metric


@with_input(_auroc)
def _auroc_compute(metric: Any) -> Pieces:
    """BinaryAUROC.compute(): scores and targets synced, then the curve computed over all of them."""
    metric.compute()
    return flat_pieces(metric.__dict__.pop("kept"))


# --- DeepSpeed: deepspeed.comm.all_gather with the slot layouts ZeRO and others use ---

def deepspeed_cases() -> Dict[str, Any]:
    import deepspeed.comm as ds_comm

    _join("deepspeed")
    out = {}
    tensor = data(BIG // 64, 64, 13)
    fresh = [torch.empty_like(tensor) for _ in range(WORLD)]
    ds_comm.all_gather(fresh, tensor)
    out["fresh_slots"] = fresh
    flat = torch.empty(WORLD * tensor.numel())  # ZeRO <= 0.12.3: views of one flat buffer, input in its own
    views = list(flat.view(WORLD, *tensor.shape).unbind(0))
    views[RANK].copy_(tensor)
    ds_comm.all_gather(views, views[RANK])
    out["views_input_in_slot"] = flat
    shared = torch.zeros_like(tensor)  # one tensor object repeated: torch leaves the last rank's data in it
    repeated = [shared] * WORLD
    ds_comm.all_gather(repeated, tensor)
    out["repeated_object"] = shared
    small = [torch.zeros(3) for _ in range(WORLD)]
    ds_comm.all_gather(small, torch.arange(3.0) + RANK)
    out["small"] = small
    return out


# --- open_clip: loss.gather_features, with and without local_loss; ClipLoss forward and backward ---

def open_clip_cases() -> Dict[str, Any]:
    from open_clip.loss import ClipLoss, gather_features

    _join("open_clip")
    image, text = data(BIG // 512, 512, 14), data(BIG // 512, 512, 15)
    out = {}
    for local_loss in (False, True):
        for with_grad in (False, True):
            out[f"local_loss={local_loss},with_grad={with_grad}"] = gather_features(
                image, text, local_loss=local_loss, gather_with_grad=with_grad, rank=RANK, world_size=WORLD)
    # Features that require grad, as a model's are, forward and backward through ClipLoss:
    # 64 x 256 float32 per rank, so below gloo's threshold (rewired where it is 0).
    for local_loss in (False, True):
        for with_grad in (False, True):
            generator = torch.Generator().manual_seed(1000 * (16 + 2 * local_loss + with_grad) + RANK)
            raw_image = torch.randn(64, 256, generator=generator).requires_grad_()
            raw_text = torch.randn(64, 256, generator=generator).requires_grad_()
            log_scale = torch.tensor(2.6593, requires_grad=True)  # log(1 / 0.07), open_clip's initial value
            image_features = torch.nn.functional.normalize(raw_image, dim=-1)
            text_features = torch.nn.functional.normalize(raw_text, dim=-1)
            gathered = gather_features(image_features, text_features, local_loss=local_loss,
                                       gather_with_grad=with_grad, rank=RANK, world_size=WORLD)
            loss = ClipLoss(local_loss=local_loss, gather_with_grad=with_grad, rank=RANK, world_size=WORLD)(
                image_features, text_features, log_scale.exp())
            loss.backward()
            out[f"clip_loss,local_loss={local_loss},with_grad={with_grad}"] = {
                "gathered": gathered,
                "gathered.requires_grad": torch.tensor([t.requires_grad for t in gathered]),
                "loss": loss.detach(),
                "image.grad": raw_image.grad,
                "text.grad": raw_text.grad,
                "log_scale.grad": log_scale.grad,
            }
    return out


# --- pytorch-metric-learning: utils.distributed through DistributedLossWrapper / DistributedMinerWrapper ---

PML_ROWS, PML_DIM = 80, 8192  # 2.5 MiB of float32 embeddings per rank: above gloo's threshold


def pytorch_metric_learning_cases() -> Dict[str, Any]:
    """Forward and backward through the wrappers, embeddings from a small model (requires grad).

    pytorch_metric_learning.utils.distributed.all_gather gathers the embeddings (and the
    labels, and CrossBatchMemory's enqueue mask) into ones_like slots, pops this rank's
    slot and concatenates the rest. Each case records the loss, the gradients of the
    embeddings, of the model's input and of its parameters, and what the miner returned.
    """
    from pytorch_metric_learning import losses, miners
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper, DistributedMinerWrapper

    _join("pytorch_metric_learning")
    torch.manual_seed(0)  # the same model on every rank, as DDP would have it
    model = torch.nn.Linear(32, PML_DIM)
    out: Dict[str, Any] = {}

    def step(name: str, seed: int, run: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        model.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(1000 * seed + RANK)
        features = torch.randn(PML_ROWS, 32, generator=generator).requires_grad_()
        labels = torch.randint(0, 10, (PML_ROWS,), generator=generator)
        embeddings = model(features)
        embeddings.retain_grad()
        loss, extra = run(embeddings, labels)
        assert torch.isfinite(loss), f"{name}: loss {loss}"
        loss.backward()
        out[name] = {"loss": loss.detach(), "embeddings.grad": embeddings.grad, "features.grad": features.grad,
                     "weight.grad": model.weight.grad, "bias.grad": model.bias.grad, "extra": extra}

    contrastive = DistributedLossWrapper(losses.ContrastiveLoss())
    step("contrastive", 20, lambda emb, labels: (contrastive(emb, labels), None))
    ntxent = DistributedLossWrapper(losses.NTXentLoss(temperature=0.5), efficient=True)
    step("ntxent_efficient", 21, lambda emb, labels: (ntxent(emb, labels), None))

    miner = DistributedMinerWrapper(miners.MultiSimilarityMiner(epsilon=0.1))

    def mined(emb: torch.Tensor, labels: torch.Tensor) -> Any:
        pairs = miner(emb, labels)  # the wrapper gathers emb (requires grad); the miner itself runs under no_grad
        return contrastive(emb, labels, pairs), pairs

    step("miner+contrastive", 22, mined)
    triplet_miner = DistributedMinerWrapper(miners.TripletMarginMiner(margin=0.2), efficient=True)
    triplet = DistributedLossWrapper(losses.TripletMarginLoss(margin=0.2), efficient=True)

    def mined_efficient(emb: torch.Tensor, labels: torch.Tensor) -> Any:
        triplets = triplet_miner(emb, labels)
        return triplet(emb, labels, triplets), triplets

    step("triplet_miner+triplet_efficient", 23, mined_efficient)
    memory = DistributedLossWrapper(losses.CrossBatchMemory(losses.ContrastiveLoss(), PML_DIM, memory_size=256))

    def cross_batch(emb: torch.Tensor, labels: torch.Tensor) -> Any:
        enqueue = torch.arange(PML_ROWS) % 4 == RANK  # a bool tensor gathered too
        return memory(emb, labels, enqueue_mask=enqueue), [memory.loss.embedding_memory, memory.loss.label_memory]

    step("cross_batch_memory", 24, cross_batch)
    return out


SCENARIOS: Dict[str, Callable[[], Dict[str, Any]]] = {
    "accelerate": accelerate_cases,
    "transformers": transformers_cases,
    "torchmetrics": torchmetrics_cases,
    "deepspeed": deepspeed_cases,
    "open_clip": open_clip_cases,
    "pytorch_metric_learning": pytorch_metric_learning_cases,
}


def own_module(library: str) -> ModuleType:
    """A library whose scenarios live in a module of their own, ``integration/job_<library>.py``.

    It defines ``cases()`` (like the ``*_cases`` functions above), ``join()`` (joins the
    job's process group as the library's users do) and ``memory_paths()`` (like
    ``memory_paths`` here), and may use this module's helpers through ``import job``.
    """
    sys.modules.setdefault("job", sys.modules[__name__])  # this script is __main__: not imported twice
    return importlib.import_module(f"job_{library}")


def main() -> None:
    library, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if library.endswith("-memory"):
        result: Any = memory(library[:-len("-memory")])
    else:
        cases = SCENARIOS[library] if library in SCENARIOS else own_module(library).cases
        result = {name: digest(value) for name, value in cases().items()}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as out:
        json.dump(result, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
