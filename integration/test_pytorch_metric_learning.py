"""pytorch-metric-learning, unedited: DistributedLossWrapper and DistributedMinerWrapper on 2 gloo ranks.

pytorch_metric_learning.utils.distributed.all_gather gathers an input that requires grad
into ones_like slots, pops its own rank's slot and concatenates the rest. memgather has
no built-in target for it: like a user, the runs name the module prefix
(MEMGATHER_TARGETS=pytorch_metric_learning), which has no version gate.
"""

from __future__ import annotations

from pathlib import Path

from integration.harness import ELIDE_ALL, ON, VERIFY, compare

TARGET = {"MEMGATHER_TARGETS": "pytorch_metric_learning"}

# Per rank and run, utils.distributed.all_gather is called 15 times: embeddings and labels
# for each of the 4 loss-wrapper calls and 2 miner-wrapper calls, plus CrossBatchMemory's
# enqueue mask. 7 of them gather the 2.5 MiB of embeddings; 8 are small (int64 labels,
# a bool mask).
CALLS, BIG_CALLS = 15, 7


def test_results_identical_and_calls_rewired(tmp_path: Path) -> None:
    runs = compare("pytorch_metric_learning", tmp_path, modes={
        # As a user would switch it on: the embeddings are rewired, the small gathers stay with
        # torch; elision is off (its own rank's slot is popped before the cat: not proven), so the
        # slots are filled where they lie.
        "memgather": {**ON, **TARGET},
        # Issue 12, item 5: every call rewired and cat elision forced on. This raised "A view
        # was created in no_grad mode and is being modified inplace with grad mode" before
        # memgather's copies ran under no_grad. The cat that follows pops a slot first, so
        # nothing is elided: the slots are rebound to one buffer, then copied by torch.cat.
        "elide_all": {**ELIDE_ALL, **TARGET},
        # The same, every rewired call checked against torch's all_gather as it runs.
        "verify": {**VERIFY, **TARGET, "MEMGATHER_ELIDE": "1"},
    })
    for report in runs["memgather"].reports.values():
        assert report.calls == CALLS and report.rewired == BIG_CALLS, report.line
        assert report.strategies == {"in_slots": BIG_CALLS, "fallback": CALLS - BIG_CALLS}, report.line
    for mode in ("elide_all", "verify"):
        for report in runs[mode].reports.values():
            assert report.calls == report.rewired == CALLS, report.line
            assert report.strategies == {"rebind": CALLS}, report.line
