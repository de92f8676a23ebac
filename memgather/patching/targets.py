"""Which callers memgather rewires: the target registry (data) and its version gates.

A target is a library (or any module prefix a user names) whose calls to
``torch.distributed.all_gather`` memgather may rewire. Built-in targets carry
the distribution whose installed version must fall in a tested range; that
version is read from distribution metadata, never by importing the library
(``memgather.patching.releases``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, List, Optional, Tuple

from memgather.patching import releases
from memgather.patching.releases import Verdict

_log = logging.getLogger("memgather")

EVERY_CALLER = "*"


@dataclass(frozen=True)
class Target:
    """One rewirable caller.

    ``prefixes``: module names whose calls are rewired (a module matches a prefix
    it equals or lies below). ``distribution``/``versions``: the installed
    distribution and the PEP 440 range it must satisfy (prereleases allowed);
    None/"" for no gate. ``note``: what its gather code does with the slots.
    Whether cat elision is on by default is decided per call site, from its
    code, not per target (``memgather.patching.sites``).
    """

    name: str
    prefixes: Tuple[str, ...]
    distribution: Optional[str] = None
    versions: str = ""
    note: str = ""
    family: str = ""  # selecting the family name selects every member

    @property
    def family_name(self) -> str:
        return self.family or self.name


_LIGHTNING = (
    "fabric.all_gather, LightningModule.all_gather, the strategies' all_gather: _all_gather_ddp_if_available, "
    "torch.distributed.nn's all_gather (an autograd Function, empty_like slots) then torch.stack; "
    "TorchCollective.all_gather: the caller's slots; _gather_all_tensors: zeros_like slots kept as a list"
)

BUILTIN: Tuple[Target, ...] = (
    Target(
        "accelerate",
        ("accelerate",),
        "accelerate",
        ">=0.20,<2",
        "gather(): empty_like slots + torch.cat (every release before 0.24.0, and on gloo/CPU after); "
        "clone() slots before 0.20.0",
    ),
    Target(
        "deepspeed",
        ("deepspeed",),
        "deepspeed",
        ">=0.9,<1",
        "ZeRO <= 0.12.3: adjacent views of a flat buffer, input in its own slot (direct); later list calls "
        "in sequence parallel / MoE / Muon may repeat one padding tensor (left to torch)",
    ),
    Target(
        "transformers",
        ("transformers",),
        "transformers",
        ">=4.0,<6",
        "trainer_pt_utils.distributed_concat: clone() slots + torch.cat, list dropped",
    ),
    Target(
        "torchmetrics",
        ("torchmetrics",),
        "torchmetrics",
        ">=0.11,<2",
        "gather_all_tensors: zeros_like slots kept as a list; gathered[rank] = local afterwards",
    ),
    # One family, three top-level packages released in step, each gated by its own release:
    # lightning_fabric ships as its own distribution and inside pytorch-lightning's wheel.
    Target("lightning", ("lightning",), "lightning", ">=2.0,<3", _LIGHTNING, "lightning"),
    Target("lightning_fabric", ("lightning_fabric",), "lightning_fabric", ">=2.0,<3", _LIGHTNING, "lightning"),
    Target("pytorch_lightning", ("pytorch_lightning",), "pytorch_lightning", ">=2.0,<3", _LIGHTNING, "lightning"),
    Target(
        "open_clip",
        ("open_clip",),
        "open_clip_torch",
        ">=2.0,<4",
        "gather_features: zeros_like slots, gathered[rank] = local, then torch.cat",
    ),
    Target(
        "mmengine",
        ("mmengine",),
        "mmengine",
        ">=0.7,<1",
        "dist.all_gather: empty_like slots returned as a list; all_gather_object / collect_results(device='gpu'): "
        "torch's all_gather_object (adjacent views of one buffer)",
    ),
    Target(
        "ignite",
        ("ignite",),
        "pytorch-ignite",
        ">=0.4,<0.6",
        "native backend's _do_all_gather (idist.all_gather, EpochMetric.compute): zeros_like slots, the gather "
        "in either branch of an if, torch.cat; _get_all_hostnames: zeros_like slots read one by one",
    ),
    Target(
        "monai",
        ("monai",),
        "monai",
        ">=0.6,<2",
        "utils.dist.evenly_divisible_all_gather without ignite: zeros_like slots padded to the longest rank, "
        "returned as slices (then torch.cat with concat=True); with ignite installed it gathers through ignite",
    ),
)

_BY_NAME: Dict[str, Tuple[Target, ...]] = {}
for _target in BUILTIN:
    for _key in {_target.name, _target.family_name}:
        _BY_NAME[_key] = _BY_NAME.get(_key, ()) + (_target,)


@dataclass(frozen=True)
class Selection:
    """The targets one ``patch()`` selected; ``every`` means any caller at all."""

    targets: Tuple[Target, ...]
    every: bool = False

    @property
    def names(self) -> Tuple[str, ...]:
        return ((EVERY_CALLER,) if self.every else ()) + tuple(t.name for t in self.targets)

    def match(self, module: str) -> Optional[Target]:
        """The target whose longest prefix contains ``module``, if any."""
        best: Optional[Target] = None
        best_length = -1
        for target in self.targets:
            for prefix in target.prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                    best, best_length = target, len(prefix)
        if best is None and self.every and not _is_own(module):
            return _EVERY
        return best


_EVERY = Target(EVERY_CALLER, (), note="every caller")


def _is_own(module: str) -> bool:
    return module == "memgather" or module.startswith("memgather.")


def select(names: Optional[Iterable[str]] = None) -> Selection:
    """Built-in target names, module prefixes of one's own, or "*" for every caller.

    ``None`` selects every built-in target.
    """
    if names is None:
        return Selection(BUILTIN)
    if isinstance(names, str):
        raise TypeError(f"targets must be a list of names, not the string {names!r} (did you mean [{names!r}]?)")
    chosen: List[Target] = []
    every = False
    for raw in names:
        name = raw.strip()
        if name == EVERY_CALLER:
            every = True
        elif name in _BY_NAME:
            chosen.extend(_BY_NAME[name])
        elif _is_module_name(name):
            chosen.append(Target(name, (name,), note="named by the user"))
        else:
            raise ValueError(
                f"target {raw!r} is neither a built-in target ({', '.join(_BY_NAME)}), a dotted module name, nor '*'"
            )
    return Selection(tuple(dict.fromkeys(chosen)), every)


def _is_module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


@lru_cache(maxsize=None)
def _gate(target: Target, force: bool, imported: bool) -> Verdict:
    if target.distribution is None:
        return Verdict(True, None, "no version gate")
    verdict = releases.verdict(target.distribution, target.versions, "tested range", target.prefixes[0])
    if verdict.allowed or not force:
        return verdict
    return Verdict(True, verdict.version, f"{verdict.reason}; forced", verdict.source)


def gate(target: Target, force: bool = False) -> Verdict:
    """Check ``target``'s installed version against its range (cached; see ``memgather.patching.releases``).

    Cached apart for before and after the target is imported: only then can a
    module without distribution metadata show its ``__version__``.
    """
    return _gate(target, force, bool(target.prefixes) and releases.imported(target.prefixes[0]))
