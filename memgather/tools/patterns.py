"""The caller patterns ``memgather bench`` measures: gather code as libraries write it.

The code is in ``pattern_code.py`` beside this file, loaded as a module of its
own (``memgather_bench_patterns``), outside the memgather package's names,
because memgather recognises its callers by module and skips its own frames:
this is user code, and is patched as a target named after that module. Each
pattern takes the rank's input and returns what the caller ends up holding (a
tensor or a list of tensors).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Tuple

MODULE = "memgather_bench_patterns"

_SOURCE = Path(__file__).with_name("pattern_code.py")  # the code, loaded under MODULE (see load)


@dataclass(frozen=True)
class Pattern:
    """One row of the benchmark."""

    name: str
    label: str
    stands_for: str
    elide: bool  # whether memgather's default elides its cat: the proof's verdict on its code


PATTERNS: Tuple[Pattern, ...] = (
    Pattern("empty_like_cat", "empty_like + cat", "accelerate < 0.24, and accelerate on gloo/CPU today", True),
    Pattern("clone_cat", "clone + cat", "transformers distributed_concat", True),
    Pattern("ones_like_cat", "ones_like + cat", "MoCo concat_all_gather", True),
    Pattern("zeros_like_branches", "zeros_like + cat, method", "ignite _do_all_gather", True),
    Pattern("zeros_like_list", "zeros_like list", "torchmetrics gather_all_tensors", False),
    Pattern("views_in_place", "views, input in slot", "DeepSpeed <= 0.12.3 ZeRO", False),
    Pattern("single_tensor", "single-tensor call", "hand-fixed code; memgather.gather under memgather", False),
)

BY_NAME: Dict[str, Pattern] = {p.name: p for p in PATTERNS}


def load() -> types.ModuleType:
    """The pattern module: ``pattern_code.py`` loaded under the name ``MODULE``, once per process, and
    registered in sys.modules."""
    module = sys.modules.get(MODULE)
    if module is None:
        spec = importlib.util.spec_from_file_location(MODULE, _SOURCE)
        assert spec is not None and spec.loader is not None, _SOURCE
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[MODULE]
            raise
    return module


def function(name: str, memgather_mode: bool) -> Callable:
    """The code to run for a pattern; the hand-fixed row uses memgather.gather under memgather."""
    if name == "single_tensor" and memgather_mode:
        import memgather

        return memgather.gather
    return getattr(load(), name)
