"""open_clip, unedited: loss.gather_features with and without local_loss, on 2 gloo ranks."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from integration.harness import compare


def _autograd_apply_has_a_python_frame() -> bool:
    """Whether ``torch.autograd.Function.apply`` runs Python code of torch.autograd.function.

    Up to torch 2.13 it is a classmethod there; from 2.14 it is torch's C function itself.
    """
    return isinstance(inspect.getattr_static(torch.autograd.Function, "apply"), classmethod)


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("open_clip", tmp_path)  # asserts every run's results are torch's
    # Eight gathers per rank: image and text features, 3 MiB per rank each, with and without
    # local_loss and gather_with_grad. The four without gradients call dist.all_gather from
    # open_clip.loss into zeros_like slots (then replace the local one): rewired, filled where
    # they lie. The four with gradients call torch.distributed.nn.functional.all_gather, an
    # autograd Function whose forward fills empty_like slots through dist.all_gather. Who
    # called it depends on torch: memgather's caller walk (memgather/callers.py) passes
    # torch.distributed's frames, then meets Function.apply. Where apply is Python code in
    # torch.autograd.function (torch <= 2.13), the walk stops there, no target: those four
    # are left to torch and never counted. Where apply has no Python frame (torch 2.14.1,
    # which this environment pins), the walk reaches open_clip.loss: all eight are rewired.
    # Issue 13, "caller attribution through autograd Functions", makes the first case
    # rewire them too.
    expected = 4 if _autograd_apply_has_a_python_frame() else 8
    for mode in ("memgather", "verify"):
        for report in runs[mode].reports.values():
            assert report.calls == report.rewired == expected, report.line
            assert report.strategies == {"in_slots": expected}, report.line
