"""Lightning, unedited, on the job's ranks: the scenarios of ``job.py lightning``.

Both distributions of Lightning 2.x are used, and both namespaces of each API:
``lightning`` (the unified package: ``lightning.fabric``, ``lightning.pytorch``) and
``pytorch-lightning`` (whose wheel ships the top-level ``pytorch_lightning`` and
``lightning_fabric``). They are separate copies of the same code, so memgather sees
different calling modules: ``lightning.fabric.utilities.distributed`` for the first,
``lightning_fabric.utilities.distributed`` for the second.

How each path reaches ``torch.distributed.all_gather`` (Lightning 2.6.6):

* ``Fabric.all_gather(data, sync_grads=...)`` ->
  ``apply_to_collection(data, Tensor, self._strategy.all_gather, ...)`` ->
  ``ParallelStrategy.all_gather`` -> ``_all_gather_ddp_if_available`` in
  ``*fabric.utilities.distributed``, which calls
  ``torch.distributed.nn.functional.all_gather(tensor, group)`` (under ``torch.no_grad()``
  unless ``sync_grads``) and returns ``torch.stack(gathered_tensors)``. That function is
  the autograd Function ``_AllGather``, whose forward fills ``empty_like`` slots with
  ``dist.all_gather``.
* ``LightningModule.all_gather`` -> ``self.trainer.strategy.all_gather`` ->
  ``pytorch_lightning.strategies.parallel.ParallelStrategy.all_gather`` -> the same
  ``_all_gather_ddp_if_available``, imported from ``lightning_fabric.utilities.distributed``
  (``lightning.fabric.utilities.distributed`` for ``lightning.pytorch``).
* ``TorchCollective.all_gather(tensor_list, tensor)`` calls ``dist.all_gather`` directly on
  the caller's list, from ``*fabric.plugins.collectives.torch_collective``.
* torchmetrics metrics in a LightningModule sync in ``Metric.compute()`` through
  ``torchmetrics.utilities.distributed.gather_all_tensors`` (zeros_like slots, a list).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Optional

import job
import torch
import torch.distributed as dist

_FABRIC: Optional[Any] = None  # the lightning.fabric Fabric that join() launched


def _children() -> int:
    """How many child processes this rank has (Lightning's launcher would have started some)."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as children:
        return len(children.read().split())


def _check_not_spawned(strategy: Any, world: int, rank: int) -> None:
    """Under torchrun, Lightning must take torchrun's processes, not start its own."""
    environment = strategy.cluster_environment
    assert type(environment).__name__ == "TorchElasticEnvironment", type(environment)
    assert environment.creates_processes_externally
    assert not strategy.launcher.procs and _children() == 0, "Lightning started processes of its own"
    assert (world, rank) == (job.WORLD, job.RANK), (world, rank)
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == job.WORLD


def _fabric(namespace: str) -> Any:
    fabric_module = __import__(f"{namespace}.fabric" if namespace == "lightning" else namespace,
                               fromlist=["Fabric"])
    fabric = fabric_module.Fabric(accelerator="cpu", strategy="ddp", devices=job.WORLD)
    fabric.launch()  # joins torchrun's group (the second Fabric finds it there)
    _check_not_spawned(fabric.strategy, fabric.world_size, fabric.global_rank)
    return fabric


def join() -> None:
    global _FABRIC
    _FABRIC = _fabric("lightning")


def memory_paths() -> Dict[str, Callable[[torch.Tensor], job.Pieces]]:
    """job.memory's paths, through lightning.fabric (the Fabric join() launched)."""
    from lightning.fabric.plugins.collectives import TorchCollective

    fabric = _FABRIC
    assert fabric is not None
    collective = TorchCollective().setup()  # the group exists: setup() leaves it as it is

    def fabric_all_gather(tensor: torch.Tensor) -> job.Pieces:
        return job.list_pieces(fabric.all_gather(tensor))  # (WORLD, n): row r is rank r's

    def sync_grads(tensor: torch.Tensor) -> job.Pieces:
        # The input requires grad, as a model's output does; no backward.
        gathered = fabric.all_gather(tensor.detach().requires_grad_(), sync_grads=True)
        assert gathered.requires_grad
        return job.list_pieces(gathered)

    def collective_all_gather(tensor: torch.Tensor) -> job.Pieces:
        slots = [torch.empty_like(tensor) for _ in range(job.WORLD)]  # the caller's slots
        return job.list_pieces(collective.all_gather(slots, tensor))

    def gather_all_tensors(tensor: torch.Tensor) -> job.Pieces:
        # lightning_fabric's copy of torchmetrics' gather_all_tensors: the list returned, concatenated by the caller.
        from lightning.fabric.utilities.distributed import _gather_all_tensors

        return job.flat_pieces(torch.cat(_gather_all_tensors(tensor)))

    return {"Fabric.all_gather": fabric_all_gather, "Fabric.all_gather(sync_grads=True)": sync_grads,
            "TorchCollective.all_gather": collective_all_gather, "_gather_all_tensors + cat": gather_all_tensors}


# --- Fabric.all_gather ---

def _fabric_cases(fabric: Any, name: str, seed: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    big = job.data(job.BIG // 64, 64, seed)
    gathered = fabric.all_gather(big)
    assert gathered.shape == (job.WORLD, *big.shape) and not gathered.requires_grad
    out[f"{name}.all_gather"] = gathered

    # sync_grads=True: the gathered tensor carries the autograd graph back to every rank's input.
    tensor = job.data(job.BIG // 64, 64, seed + 1).requires_grad_()
    gathered = fabric.all_gather(tensor, sync_grads=True)
    assert gathered.requires_grad
    weight = torch.linspace(-2, 2, gathered.numel()).reshape(gathered.shape)  # the same on every rank
    (gathered * weight).sum().backward()
    # Each rank's loss sees this rank's input with weight[RANK]; the backward sums the WORLD copies.
    assert torch.equal(tensor.grad, job.WORLD * weight[job.RANK]), "wrong input gradient"
    out[f"{name}.all_gather(sync_grads=True)"] = {"gathered": gathered.detach(), "input.grad": tensor.grad}

    # A nested collection: each tensor is gathered on its own (and Python numbers become tensors).
    nested = fabric.all_gather({
        "logits": job.data(job.BIG // 128, 128, seed + 2),
        "labels": torch.arange(6) + 10 * job.RANK,
        "pair": [big.t(), torch.tensor(float(job.RANK))],  # non-contiguous (made contiguous), and 0-d
        "half": (job.data(job.BIG // 64, 64, seed + 3, torch.bfloat16),),
        "count": 3 + job.RANK,
    })
    assert nested["pair"][0].shape == (job.WORLD, 64, job.BIG // 64) and nested["count"].tolist() == [3, 4]
    out[f"{name}.all_gather(nested)"] = nested
    return out


# --- TorchCollective.all_gather ---

def _collective_cases(namespace: str, seed: int) -> Dict[str, Any]:
    collectives = __import__(f"{namespace}.plugins.collectives", fromlist=["TorchCollective"])
    out: Dict[str, Any] = {}
    world = collectives.TorchCollective().setup()  # the group exists: setup() leaves it as it is
    assert world.group is dist.GroupMember.WORLD and world.world_size == job.WORLD and world.rank == job.RANK
    tensor = job.data(job.BIG // 64, 64, seed)
    slots = [torch.empty_like(tensor) for _ in range(job.WORLD)]
    assert world.all_gather(slots, tensor) is slots
    out[f"{namespace}.TorchCollective.all_gather"] = slots
    own = collectives.TorchCollective().create_group()  # a new group of every rank
    tensor = job.data(job.BIG // 32, 32, seed + 1)
    slots = [torch.zeros_like(tensor) for _ in range(job.WORLD)]
    own.all_gather(slots, tensor)
    out[f"{namespace}.TorchCollective(create_group).all_gather"] = slots
    own.teardown()  # destroys its own group only
    return out


# --- the Trainer: LightningModule.all_gather and torchmetrics inside a ddp fit ---

def _trainer_case(namespace: str, seed: int, root: str) -> Dict[str, Any]:
    """A tiny model fitted for 2 epochs of 2 steps on each rank, validated after each epoch.

    training_step gathers the batch's embeddings with sync_grads=True (small) and trains on
    a loss over every rank's; on_validation_epoch_end gathers a big tensor through
    LightningModule.all_gather and computes a CatMetric with a big state (torchmetrics
    syncs it); a MeanSquaredError is logged as a metric object, and the validation loss
    with sync_dist=True (an all_reduce).
    """
    pl = __import__(namespace if namespace == "pytorch_lightning" else "lightning.pytorch", fromlist=["Trainer"])
    from torch.utils.data import DataLoader, TensorDataset
    from torchmetrics import MeanSquaredError
    from torchmetrics.aggregation import CatMetric

    gathered: Dict[str, Any] = {}

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 8)
            self.val_cat = CatMetric()
            self.val_mse = MeanSquaredError()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            everyone = self.all_gather(self.layer(x), sync_grads=True)  # (WORLD, batch, 8)
            return ((everyone.mean(0) - y) ** 2).mean() + everyone[job.RANK].pow(2).mean() * 0.1

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            prediction = self.layer(x)
            self.val_mse.update(prediction, y)
            self.log("val_mse", self.val_mse)
            self.log("val_loss", ((prediction - y) ** 2).mean(), sync_dist=True)
            # BIG / 2 elements a batch: a 3 MiB state per rank after the epoch's 2 batches.
            features = job.data(job.BIG // 128, 64, seed + 10 * batch_idx).reshape(-1)
            self.val_cat.update(features.nan_to_num() * self.layer.weight.detach().sum())

        def on_validation_epoch_end(self) -> None:
            epoch = self.current_epoch
            gathered[f"epoch{epoch}.val_cat.compute()"] = self.val_cat.compute()
            self.val_cat.reset()
            big = job.data(job.BIG // 64, 64, seed + 100 + epoch) + self.layer.bias.detach().sum()
            everything = self.all_gather({"big": big, "step": torch.tensor(self.global_step)})
            assert everything["big"].shape == (job.WORLD, *big.shape)
            gathered[f"epoch{epoch}.all_gather"] = everything

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(seed, verbose=False)
    generator = torch.Generator().manual_seed(seed)  # the same samples on every rank; the sampler splits them
    x, y = torch.randn(16, 16, generator=generator), torch.randn(16, 8, generator=generator)
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu", strategy="ddp", devices=job.WORLD, max_epochs=2, limit_train_batches=2,
        limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, default_root_dir=root,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
                DataLoader(TensorDataset(x, y), batch_size=4))
    _check_not_spawned(trainer.strategy, trainer.world_size, trainer.global_rank)
    assert trainer.global_step == 4 and len(gathered) == 4, (trainer.global_step, list(gathered))
    torch.use_deterministic_algorithms(False)  # deterministic=True set it for the whole process
    return {"gathered": gathered, "weights": dict(model.state_dict()),
            "val_mse": trainer.callback_metrics["val_mse"], "val_loss": trainer.callback_metrics["val_loss"]}


def cases() -> Dict[str, Any]:
    join()
    assert _FABRIC is not None
    out: Dict[str, Any] = {}
    out.update(_fabric_cases(_FABRIC, "lightning.fabric.Fabric", 50))
    out.update(_fabric_cases(_fabric("lightning_fabric"), "lightning_fabric.Fabric", 60))
    out.update(_collective_cases("lightning.fabric", 70))
    out.update(_collective_cases("lightning_fabric", 80))
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL":
        root = os.path.join(sys.argv[2], "trainer")
        out["pytorch_lightning.Trainer"] = _trainer_case("pytorch_lightning", 90, root)
        out["lightning.pytorch.Trainer"] = _trainer_case("lightning.pytorch", 90, root)
    # else: torch's DistributedDataParallel constructor segfaults under TORCH_DISTRIBUTED_DEBUG=DETAIL
    # on a gloo group (in Logger.set_construction_data_and_log; torch 2.12.1 to 2.15.0, without Lightning
    # or memgather too: DistributedDataParallel(torch.nn.Linear(4, 2)) after init_process_group("gloo")).
    return out
