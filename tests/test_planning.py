"""Property-based tests of the planning logic against a plain reference model.

``strategies.choose`` only looks at this rank's arguments (no communication),
so it runs here in-process, on layouts hypothesis combines freely.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memgather.engine.strategies import choose

LAYOUTS = [
    "fresh", "adjacent", "adjacent_input_own", "adjacent_input_other", "reversed_adjacent", "gapped",
    "fresh_one_view_held", "duplicate", "one_requires_grad", "one_wrong_shape", "one_wrong_dtype",
    "one_noncontiguous", "input_is_fresh_slot", "tuple",
]


def build(layout: str, world: int, rank: int, shape: Tuple[int, ...], dtype: torch.dtype) -> Tuple[Any, torch.Tensor, Any]:
    """(tensor_list, input, keepalive) for one layout."""
    numel = math.prod(shape)
    data = torch.arange(numel, dtype=torch.float64).reshape(shape).to(dtype)

    def fresh() -> List[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype) for _ in range(world)]

    def views(order: List[int], gap: int = 0) -> List[torch.Tensor]:
        buffer = torch.empty(world * (numel + gap), dtype=dtype)
        return [buffer[i * (numel + gap): i * (numel + gap) + numel].view(shape) for i in order]

    if layout == "fresh":
        return fresh(), data, None
    if layout == "adjacent":
        return views(list(range(world))), data, None
    if layout == "adjacent_input_own":
        slots = views(list(range(world)))
        return slots, slots[rank], None
    if layout == "adjacent_input_other":
        slots = views(list(range(world)))
        return slots, slots[(rank + 1) % world], None
    if layout == "reversed_adjacent":
        return views(list(reversed(range(world)))), data, None
    if layout == "gapped":
        return views(list(range(world)), gap=1), data, None
    if layout == "fresh_one_view_held":
        slots = fresh()
        return slots, data, slots[-1].view(-1)[:1]
    if layout == "duplicate":
        slot = torch.empty(shape, dtype=dtype)
        return [slot] * world, data, None
    if layout == "one_requires_grad":
        slots = fresh()
        slots[-1] = torch.zeros(shape, dtype=torch.float32, requires_grad=True) if dtype == torch.float32 else slots[-1]
        return slots, data, None
    if layout == "one_wrong_shape":
        slots = fresh()
        slots[-1] = torch.empty((numel + 1,), dtype=dtype)
        return slots, data, None
    if layout == "one_wrong_dtype":
        slots = fresh()
        slots[-1] = torch.empty(shape, dtype=torch.float64)
        return slots, data, None
    if layout == "one_noncontiguous":
        slots = fresh()
        slots[-1] = torch.empty(shape[::-1], dtype=dtype).t() if len(shape) == 2 else slots[-1]
        return slots, data, None
    if layout == "input_is_fresh_slot":
        slots = fresh()
        slots[rank].copy_(data)
        return slots, slots[rank], None
    if layout == "tuple":
        return tuple(fresh()), data, None
    raise ValueError(layout)


def model(layout: str, world: int, shape: Tuple[int, ...], dtype: torch.dtype) -> str:
    """The strategy (or fallback reason) a careful reader would expect."""
    # A transposed 2-D slot is non-contiguous only when both dims exceed 1.
    transposed = layout == "one_noncontiguous" and len(shape) == 2 and min(shape) > 1
    if math.prod(shape) == 0:  # the input is looked at before the slots
        return "empty"
    if layout == "tuple":
        return "not_a_list"
    if layout == "one_requires_grad":
        return "slot_requires_grad" if dtype == torch.float32 else ("rebind" if world > 1 else "direct")
    if layout == "one_wrong_shape":
        return "uneven_slots"
    if layout == "one_wrong_dtype":
        return "dtype_mismatch"
    if world == 1:
        # One slot: a region of its own, unless it is not contiguous.
        return "slot_not_contiguous" if transposed else "direct"
    if layout == "duplicate":
        return "duplicate_slot"
    if layout in ("adjacent", "adjacent_input_own"):
        return "direct"
    if layout == "adjacent_input_other":
        return "input_overlaps_output"
    if layout in ("reversed_adjacent", "gapped", "fresh_one_view_held"):
        return "slots_shared"
    if layout == "one_noncontiguous" and len(shape) == 2:
        # Contiguous or not, a .t() view keeps its base alive: it does not hold its storage alone.
        return "slot_not_contiguous" if transposed else "slots_shared"
    if layout == "input_is_fresh_slot":
        return "input_overlaps_output"
    return "rebind"


@settings(max_examples=400, deadline=None, derandomize=True)  # the same examples on every CI run
@given(
    layout=st.sampled_from(LAYOUTS),
    world=st.integers(1, 4),
    rank_seed=st.integers(0, 3),
    shape=st.sampled_from([(), (3,), (2, 3), (4, 1), (0,), (2, 0)]),
    dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]),
)
def test_plan_matches_the_model(layout: str, world: int, rank_seed: int, shape: Tuple[int, ...], dtype: torch.dtype) -> None:
    rank = rank_seed % world
    tensor_list, tensor, keep = build(layout, world, rank, shape, dtype)
    outcome = choose(tensor_list, tensor, world, rank).value
    assert outcome == model(layout, world, shape, dtype), (layout, world, rank, shape, dtype)
    del keep
