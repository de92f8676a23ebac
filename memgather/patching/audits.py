"""Where cat elision is on by default: the call sites read and found to drop the list (data).

Elision makes ``torch.cat`` of the gathered slots return memgather's buffer,
so the result shares memory with the slots: safe only where the caller never
uses the list again. That was checked by reading code, one function at a
time, in the releases named beside each entry. A call from any other
function, or from a release outside the range read, gets elision only when
the user asks for it (``patch(elide=True)``, ``MEMGATHER_ELIDE=1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import FrameType
from typing import Dict, Optional, Tuple

from memgather.patching import callers, releases
from memgather.patching.releases import Verdict


@dataclass(frozen=True)
class AuditedSite:
    """A function that calls ``all_gather``, read and found to drop the gathered list.

    It gathers into fresh slots, ``torch.cat``s them along dim 0 and returns
    only the concatenation (or a slice of it). ``module`` and ``qualname`` name
    the function, ``qualname`` as ``co_qualname`` spells it (a nested function
    is ``outer.<locals>.inner``). ``versions``: the PEP 440 range of
    ``distribution``'s releases the audit covers; ``read``: the releases whose
    code was read; ``note``: what the code does.
    """

    module: str
    qualname: str
    distribution: str
    versions: str
    read: Tuple[str, ...]
    note: str

    @property
    def name(self) -> str:
        """``module:qualname``, as ``memgather doctor`` and docs/targets.md print it."""
        return f"{self.module}:{self.qualname}"


AUDITED: Tuple[AuditedSite, ...] = (
    # Read in accelerate 0.20.0, 0.23.0, 0.24.0, 1.0.0 and 1.15.0: the same nested
    # function in each, and its list path the same in each (empty_like slots, all_gather,
    # `return torch.cat(output_tensors, dim=0)`). 0.20.0 is the target's lower bound;
    # from 0.24.0 on, backends other than gloo take all_gather_into_tensor instead, and
    # the list path runs on gloo/CPU only. Nothing after 1.15.0 was read. The same inner
    # name in utils.megatron_lm (gather_across_data_parallel_groups.<locals>._gpu_gather_one)
    # and operations._neuron_gather_object (1.15.0) were not audited.
    AuditedSite(
        "accelerate.utils.operations",
        "_gpu_gather.<locals>._gpu_gather_one",
        "accelerate",
        ">=0.20.0,<=1.15.0",
        ("0.20.0", "0.23.0", "0.24.0", "1.0.0", "1.15.0"),
        "empty_like slots, all_gather, returns torch.cat(slots, dim=0); from 0.24.0 on gloo/CPU only",
    ),
    # Read in transformers 4.0.0, 4.40.0 and 5.24.0: clone() slots, all_gather,
    # `concat = torch.cat(output_tensors, dim=0)`, returns concat or concat[:n]
    # (4.40.0 and 5.24.0 also recurse into dicts, and atleast_1d().contiguous() the input).
    # Nothing after 5.24.0 was read. distributed_broadcast_scalars has the same shape
    # but was not part of the audit.
    AuditedSite(
        "transformers.trainer_pt_utils",
        "distributed_concat",
        "transformers",
        ">=4.0.0,<=5.24.0",
        ("4.0.0", "4.40.0", "5.24.0"),
        "clone() slots, all_gather, returns torch.cat(slots, dim=0) or a slice of it",
    ),
    # Read in lightning_fabric 2.1.0, 2.2.0, 2.3.0, 2.4.0, 2.5.0 and 2.6.6, and in lightning
    # 2.1.0, 2.3.0, 2.5.0 and 2.6.6 (the same file, lightning.fabric's imports): the same
    # four lines in each: `tensor = tensor.contiguous()`, then under no_grad unless
    # sync_grads, `gathered_tensors = all_gather(tensor, group)` (torch.distributed.nn's
    # Function: empty_like slots, dist.all_gather, returns them as a tuple), then
    # `return torch.stack(gathered_tensors)`. fabric.all_gather, LightningModule.all_gather
    # and the DDP strategies' all_gather reach it. 2.0.x went through a helper of its own
    # (_functional_all_gather), a different caller: not covered. Nothing after 2.6.6 was read.
    # Slots with history (sync_grads on an input that requires grad) are never elided. What
    # torch's Function does with its slots is not gated by torch release: the cat-time proof
    # (elision._invisible) checks, whatever torch did, that the stacked tensors are exactly
    # the gathered slots in order and that nothing else holds them or their buffer.
    AuditedSite(
        "lightning_fabric.utilities.distributed",
        "_all_gather_ddp_if_available",
        "lightning_fabric",
        ">=2.1.0,<=2.6.6",
        ("2.1.0", "2.2.0", "2.3.0", "2.4.0", "2.5.0", "2.6.6"),
        "torch.distributed.nn's all_gather (empty_like slots), returns torch.stack(slots)",
    ),
    AuditedSite(
        "lightning.fabric.utilities.distributed",
        "_all_gather_ddp_if_available",
        "lightning",
        ">=2.1.0,<=2.6.6",
        ("2.1.0", "2.3.0", "2.5.0", "2.6.6"),
        "torch.distributed.nn's all_gather (empty_like slots), returns torch.stack(slots)",
    ),
)

# Keyed by the code's bare name, which every Python records (co_name); the
# qualified name is then confirmed, so the per-call cost is one dict lookup.
_BY_NAME: Dict[Tuple[str, str], Tuple[AuditedSite, ...]] = {}
for _site in AUDITED:
    _key = (_site.module, _site.qualname.rpartition(".")[2])
    _BY_NAME[_key] = _BY_NAME.get(_key, ()) + (_site,)


def site_of(frame: FrameType) -> Optional[AuditedSite]:
    """The audited site whose function ``frame`` runs, whatever release is installed."""
    for site in _BY_NAME.get((callers.module_of(frame), frame.f_code.co_name), ()):
        if callers.runs(frame, site.qualname):
            return site
    return None


def covers(site: AuditedSite) -> Verdict:
    """Whether the installed release of the site's distribution is one the audit covers (cached,
    apart for before and after its module is imported; see ``memgather.patching.releases``)."""
    return _covers(site, releases.imported(site.module))


@lru_cache(maxsize=None)
def _covers(site: AuditedSite, imported: bool) -> Verdict:
    return releases.verdict(site.distribution, site.versions, "audited range", site.module)


def elides_by_default(frame: FrameType) -> bool:
    """Whether a call from ``frame`` gets cat elision when the user has not said."""
    site = site_of(frame)
    return site is not None and covers(site).allowed
