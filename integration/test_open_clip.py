"""open_clip, unedited: loss.gather_features with and without local_loss, and ClipLoss forward and
backward, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from integration.harness import ELIDE_ALL, ON, VERIFY, compare


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
    # (its backward scatters: no all_gather). memgather attributes a gather inside a
    # Function's forward to the code that applied the Function (memgather/patching/callers.py):
    # here open_clip.loss, whether or not Function.apply is Python code of its own (it is
    # up to torch 2.13; from 2.14, which this environment pins, it is torch's C function).
    big, small = 8, 16
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
        assert report.elided == 10, report.line
