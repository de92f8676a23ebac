"""open_clip, unedited: loss.gather_features with and without local_loss, and ClipLoss forward and
backward, on 2 gloo ranks."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from integration.harness import ELIDE_ALL, ON, VERIFY, compare


def _autograd_apply_has_a_python_frame() -> bool:
    """Whether ``torch.autograd.Function.apply`` runs Python code of torch.autograd.function.

    Up to torch 2.13 it is a classmethod there; from 2.14 it is torch's C function itself.
    """
    return isinstance(inspect.getattr_static(torch.autograd.Function, "apply"), classmethod)


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    # Each run's results must be torch's, bit for bit (compare asserts it): the gathered
    # features, and for ClipLoss the loss and the gradients of the features and the scale.
    runs = compare("open_clip", tmp_path, modes={
        "memgather": ON,
        # Issue 12, item 5: every call rewired, cat elision forced on. Before memgather's
        # copies ran under no_grad, this raised "A view was created in no_grad mode and is
        # being modified inplace with grad mode" at the first gather of features that
        # require grad.
        "elide_all": ELIDE_ALL,
        "verify": VERIFY,
    })
    # Per rank, 8 big gathers: image and text features, 3 MiB per rank each, with and without
    # local_loss and gather_with_grad; then 16 small ones (64 x 256 float32, below gloo's
    # threshold): features that require grad, through gather_features and then through
    # ClipLoss forward and backward, in the same four settings. The gathers without
    # gradients call dist.all_gather from open_clip.loss into zeros_like slots (then replace
    # the local one). Those with gradients call torch.distributed.nn.functional.all_gather,
    # an autograd Function whose forward fills empty_like slots through dist.all_gather
    # (its backward scatters: no all_gather). Who called it depends on torch: memgather's
    # caller walk (memgather/callers.py) passes torch.distributed's frames, then meets
    # Function.apply. Where apply is Python code in torch.autograd.function (torch <= 2.13),
    # the walk stops there, no target: those calls are left to torch and never counted.
    # Where apply has no Python frame (torch 2.14.1, which this environment pins), the walk
    # reaches open_clip.loss: all of them are rewired. Issue 13, "caller attribution
    # through autograd Functions", makes the first case rewire them too.
    big, small = (4, 8) if _autograd_apply_has_a_python_frame() else (8, 16)
    for report in runs["memgather"].reports.values():
        assert report.calls == big + small and report.rewired == big, report.line
        assert report.strategies == {"in_slots": big, "fallback": small}, report.line
    for report in runs["verify"].reports.values():
        assert report.calls == report.rewired == big + small, report.line
        assert report.strategies == {"in_slots": big + small}, report.line
    for report in runs["elide_all"].reports.values():
        # Elision wants one buffer: every call is rebound and its slots armed. On torch 2.14.1,
        # 10 of the 24 cats per rank return memgather's buffer: those with local_loss and
        # without gradients (the slots are kept as gathered: 2 big, 4 small) and the big ones
        # with gather_with_grad, whose inputs do not require grad. The others are copied by
        # torch.cat: the local slot was replaced, or the slots came out of the autograd
        # Function with history (elision steps aside for slots that require grad).
        assert report.calls == report.rewired == big + small, report.line
        assert report.strategies == {"rebind": big + small}, report.line
