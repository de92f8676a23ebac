"""How the gathered bytes travel: the collective chosen per backend (step 4 of docs/calls.md).

Three routes exist:

- ``single``: one call of torch's single-tensor all-gather into the flat
  buffer. NCCL writes straight into it. On gloo it is wire-compatible with the
  list ``all_gather`` (gloo's ``_allgather_base`` chunks the output and runs
  the same allgather), so a rank that took the rewired path still meets a rank
  that fell back. Gloo still stages through a flat temporary of its own.
- ``broadcast``: ``world`` async broadcasts, rank i's into view i of the flat
  buffer. Gloo broadcasts in place, so nothing but the output is allocated.
  It is a different wire protocol, so every rank must take it or none: the
  caller agrees with the other ranks first (see ``agreement``).
- ``ring``: across hosts, gloo's broadcasts (a tree over rank numbers)
  cross the host boundary several times per gather, and measured 1.8 to
  3.5 x torch's time over a 1 Gbit/s link (tests/multihost.py). The ring
  sends each rank's part around the ranks with point-to-point transfers
  straight into the destinations: as many bytes cross each link as in gloo's
  own ring all-gather, and nothing but the output is allocated. Which of the
  two in-place routes a call takes is settled after the agreement round,
  from the host keys every rank read alike (``settle``): the ring where the
  group's ranks run on more than one host, else the broadcasts.

Gloo threshold. Broadcasts are taken from 2 MiB per rank; they save the
gathered size in memory. ``python benchmarks/route_times.py`` (``--world-size 4``
for four ranks) prints the median time per gather
of each route at each size ("broadcast" includes the agreement round) and
the size from which broadcast is faster. Below it memgather leaves gloo
calls to torch: gloo stages the single call through a temporary just as it
does the list call, so rewiring would save nothing and only add its own
microseconds (``MEMGATHER_GLOO_MIN_BYTES`` moves the threshold; 0 rewires
every gloo call).

NCCL threshold. On CUDA (both NCCL flavours) a call is rewired where the GPU
work it removes covers memgather's own CPU time, even in the case where that
time shows in full. The CPU time: about 90 us per rewired call above torch's at
2 ranks (the largest of the rewired rows ``python benchmarks/overhead.py``
prints, rounded up), growing by one slot per rank (``python
benchmarks/overhead_by_world.py`` fits 19.7 us + 3.48 us per rank on torch's
no-op fake backend, planned in full as every CUDA call is; CUDA adds per slot
the allocator's facts and a
``record_stream``), so overhead(w) = 90 us + 10 us per rank beyond 2. Where it
shows: a CUDA call only queues work, so while the CPU runs ahead of the GPU,
memgather's time overlaps work already queued and costs nothing; it shows where
the GPU waits for the host, above all in a loop that synchronises after every
gather (``.cpu()``, ``.item()``, a metric computed on the host): the GPU then
idles through each call's Python, and the removed copy must pay for it. The GPU
work removed: every rewired call saves at least one device copy of the gathered
size N = w x t (legacy NCCL: the copy of N out of torch's temporary into the
slots, and the cat's too where it is elided; ProcessGroupNCCL2, where only
elided calls are rewired: the cat's copy of N). A copy of N reads and writes N,
2N bytes at the memory bandwidth H; H is 3.35 TB/s, the HBM3 peak NVIDIA
publishes for the H100 SXM (a copy reaches less than the peak, so the credit
errs low there). So the default is the smallest per-rank size with 2 x w x t /
H >= overhead(w), rounded up to a whole MiB:

    t >= overhead(w) x H / (2 x w)

72 MiB per rank at 2 ranks, 44 at 4, 30 at 8, 23 at 16, 18 at 64 (144 at 1,
where N = t). From there on a call is not slower than torch's on memory no
faster than the H100's, even when the program synchronises after it, and it
saves N bytes of GPU memory (the temporary, or the cat's result). Faster memory
makes the removed copy shorter: on the H200 (4.8 TB/s) or the B200 (8 TB/s) the
never-slower size at 2 ranks is 103 or 172 MiB (105 at 4 ranks on the B200),
which would leave an evaluation step's logits (4 x 192 x 32000 float32, 93.75
MiB per rank) with torch; the H100 figure is the floor that rewires them. On
those GPUs, at 2 ranks, a call between the two sizes can take longer than torch's
where the program synchronises after each gather: by up to 27 (H200) or 52 us
(B200) at the threshold, 8 or 41 us at the logits' size.
``benchmarks/gpu_check.py --sweep`` measures the crossover on the GPU it runs
on. Across hosts the collective only takes longer, which changes neither side
of the rule. Memory-bound jobs lower it with ``MEMGATHER_NCCL_MIN_BYTES`` (0
rewires every call). Every input is the same on every rank, so the ranks agree;
on legacy NCCL both kinds of call run the same ncclAllGather anyway, so ranks
set differently still meet.

ProcessGroupNCCL2 fills a list's slots itself with one ncclBroadcast per rank
(no temporary), and its single-tensor call is an ncclAllGather: the two never
meet. So on NCCL2 the collective is chosen from what every rank of a working
program shares (group, size, dtype, caller, settings), without an exchange:
calls whose cat is elided (the only saving there, t + 2N to t + N) take
``SINGLE_EVERY_RANK``, every other call stays with torch. A rank whose slots
cannot be rebound must still take the single call: it gathers into a
temporary and copies into its slots (``Strategy.STAGED``: legacy NCCL's cost,
on that rank alone).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, FrozenSet, List, Optional

import torch
import torch.distributed as dist

from memgather import compat
from memgather.engine import groups, pages, slots

BROADCAST_MIN_BYTES_PER_RANK = 2 << 20
# The NCCL threshold's rule (see "NCCL threshold" above), in integers: per rank, the smallest
# t with 2 x world x t / NCCL_HBM_BYTES_PER_NS >= overhead(world), rounded up to NCCL_THRESHOLD_STEP.
NCCL_OVERHEAD_NS = 90_000  # memgather's own CPU time per rewired call at 2 ranks (benchmarks/overhead.py)
NCCL_OVERHEAD_PER_RANK_NS = 10_000  # and for each rank beyond 2 (benchmarks/overhead_by_world.py, plus CUDA's)
NCCL_HBM_BYTES_PER_NS = 3_350  # 3.35 TB/s: the H100 SXM's HBM3 peak, from NVIDIA's H100 datasheet
NCCL_COPY_PASSES = 2  # a device copy of N bytes reads N and writes N
NCCL_THRESHOLD_STEP = 1 << 20  # the default is rounded up to a whole MiB


@dataclass(frozen=True)
class Route:
    """One way to move the bytes; ``saves_temp`` says whether the backend's
    own gathered-size temporary is avoided (what ``counters`` counts as saved)."""

    name: str
    saves_temp: bool
    needs_agreement: bool
    contiguous_input_only: bool = False
    in_place: bool = False  # fills caller-chosen destinations (the slots, or views of one buffer)
    # Once chosen, every rank of the group takes it, whatever its own slots allow: a rank that
    # cannot rebind stages through a temporary instead of falling back (ProcessGroupNCCL2).
    every_rank: bool = False


# NCCL reads the input as raw memory and rejects non-contiguous ones where
# torch's list call differs in what it accepts; such inputs stay with torch.
SINGLE_IN_PLACE = Route("single_in_place", saves_temp=True, needs_agreement=False, contiguous_input_only=True)
# Gloo copies the input in logical order on both calls (tested bit for bit).
SINGLE_STAGED = Route("single_staged", saves_temp=False, needs_agreement=False)
# ProcessGroupNCCL2's single-tensor call: its list call needs no temporary, so nothing is saved
# but the elided cat; its list call is another wire protocol, so no rank may fall back alone.
SINGLE_EVERY_RANK = Route("single_every_rank", saves_temp=False, needs_agreement=False, every_rank=True)
BROADCAST = Route("broadcast", saves_temp=True, needs_agreement=True, in_place=True)
RING = Route("ring", saves_temp=True, needs_agreement=True, in_place=True)
# Accepted by gloo's collectives on every release memgather supports (complex ones are
# sent as real views, as torch's all_gather sends them); bool and bfloat16 are not on
# torch < 2.2, and int16 or unsigned ones on none.
RING_DTYPES = frozenset(
    (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.complex64,
        torch.complex128,
    )
)
# What gloo's collectives take, measured on every release tox runs (tests/test_releases.py): in
# any other dtype torch's all_gather raises "Invalid scalar type" before it touches a slot,
# where a rebind or an in-place route would already have moved or written them.
GLOO_DTYPES = RING_DTYPES | {torch.complex32}
# gloo took bool from torch 2.1 (pytorch#105354) and bfloat16 from 2.2 (pytorch#113557); tox measures
# neither release, so both are routed from 2.2, the later one (2.1's bool calls stay with torch).
GLOO_BOOL_BFLOAT16_SINCE = (2, 2)
# The ring's transfers carry a tag of their own, so that a user's own isend / irecv in
# flight on the same group (tag 0 by default) is never matched with memgather's.
RING_TAG = 0x4D47


def backend_for_device(name: str, device: torch.device) -> str:
    """Resolve a backend string, per-device ones ('cpu:gloo,cuda:nccl') included."""
    name = name.lower()
    if ":" not in name:
        return name
    for part in name.split(","):
        device_type, _, backend = part.partition(":")
        if device_type.strip() == device.type:
            return backend.strip()
    return ""


@lru_cache(maxsize=None)
def backend_on(name: str, device_type: str) -> str:
    """``backend_for_device`` by device type, cached: asked on every small call."""
    return backend_for_device(name, torch.device(device_type))


def gloo_threshold(setting: Optional[int]) -> int:
    """Bytes per rank from which gloo calls are rewired: the setting, else the default."""
    return BROADCAST_MIN_BYTES_PER_RANK if setting is None else setting


def nccl_threshold(setting: Optional[int], world: int) -> int:
    """Bytes per rank from which NCCL calls on CUDA are rewired: the setting, else the default
    for ``world`` ranks, the same on both flavours (see "NCCL threshold" above): the smallest
    size whose removed copy of the gathered bytes takes the GPU at least memgather's own time."""
    if setting is not None:
        return setting
    world = max(world, 1)
    overhead_ns = NCCL_OVERHEAD_NS + NCCL_OVERHEAD_PER_RANK_NS * max(world - 2, 0)
    copied_per_rank_byte = NCCL_COPY_PASSES * world  # a rank's t bytes: N = world x t, read and written
    steps = -(-overhead_ns * NCCL_HBM_BYTES_PER_NS // (copied_per_rank_byte * NCCL_THRESHOLD_STEP))
    return steps * NCCL_THRESHOLD_STEP  # rounded up


def gathered_limit(
    backend: str,
    device_type: str,
    nccl_flavour: Optional[str],
    world: int,
    gloo_min_bytes: Optional[int] = None,
    nccl_min_bytes: Optional[int] = None,
) -> int:
    """The gathered bytes under which a call is left to torch (0: none is): the only place it is told.

    Below it there is nothing or next to nothing to save, and memgather's own
    work would only add time. ``backend`` is the one for the tensor's device
    (``backend_on``). Gloo on CPU has its threshold, NCCL on CUDA (either
    flavour) its own; other backends have no route, so no threshold either.
    Every input is the same on every rank of a working program.
    """
    if backend == "gloo" and device_type == "cpu":
        return world * gloo_threshold(gloo_min_bytes)
    if backend.startswith("nccl") and device_type == "cuda" and nccl_flavour in ("legacy", "nccl2"):
        return world * nccl_threshold(nccl_min_bytes, world)
    return 0


def dtypes_taken(backend: str, device_type: str) -> Optional[FrozenSet[torch.dtype]]:
    """The dtypes the backend's collectives take on this device type (None: not checked, any goes)."""
    if backend != "gloo" or device_type != "cpu":
        return None  # NCCL checks the dtype before it writes, and memgather never rebinds CUDA memory
    if compat.torch_release() >= GLOO_BOOL_BFLOAT16_SINCE:
        return GLOO_DTYPES | {torch.bool, torch.bfloat16}
    return GLOO_DTYPES


def agreed(route: Optional[Route]) -> Optional[Route]:
    """``route``, taken only where every rank takes it: the ranks agree first (see ``compat.collectives_checked``)."""
    return route if route is None or route.needs_agreement else replace(route, needs_agreement=True)


def choose(
    backend: str, device: torch.device, async_op: bool, gloo_single: bool = True, nccl_flavour: Optional[str] = None
) -> Optional[Route]:
    """The route for a call at or above its threshold (``gathered_limit``), or None where no
    route is known to be safe.

    Every input here is the same on every rank of a working program, so all
    ranks choose alike. ``gloo_single`` says whether this torch's gloo has the
    single-tensor all-gather (``compat.gloo_has_single_tensor``). Synchronous
    gloo calls get ``BROADCAST``, which ``settle`` may turn into the ring once
    the ranks agreed. ``nccl_flavour`` is the group's NCCL backend
    (``compat.nccl_flavour``).
    """
    if backend == "gloo" and device.type == "cpu" and not async_op:
        return BROADCAST
    # Async gloo calls take the single call: the agreement round before the
    # broadcasts would block a call that the caller expects to return at once.
    return single_route(backend, device, gloo_single, nccl_flavour)


def single_route(
    backend: str, device: torch.device, gloo_single: bool = True, nccl_flavour: Optional[str] = None
) -> Optional[Route]:
    """Which of the two single-tensor routes a call on ``backend`` takes, or None where it has none
    (a torch whose gloo lacks the call, ProcessGroupNCCL2, another backend)."""
    if backend == "gloo" and device.type == "cpu":
        return SINGLE_STAGED if gloo_single else None
    if backend.startswith("nccl") and device.type == "cuda":
        # Only the legacy group's list call runs the single call's collective (ncclAllGather
        # into a temporary): a rank that fell back still meets one that took the single call,
        # and the temporary is saved. ProcessGroupNCCL2 fills the slots itself, with broadcasts.
        return SINGLE_IN_PLACE if nccl_flavour == "legacy" else None
    return None


def elided_route(backend: str, device: torch.device, nccl_flavour: Optional[str] = None) -> Optional[Route]:
    """The route every rank takes for a call whose cat is elided, where it differs from ``choose``'s
    (ProcessGroupNCCL2: ``SINGLE_EVERY_RANK``); None elsewhere."""
    if backend.startswith("nccl") and device.type == "cuda" and nccl_flavour == "nccl2":
        return SINGLE_EVERY_RANK
    return None


def settle(route: Route, setting: str, spans_hosts: bool, dtype: torch.dtype) -> Route:
    """The in-place route every rank takes, from what all of them read alike in the agreement round.

    ``setting`` is ``MEMGATHER_GLOO_ROUTE`` (auto, broadcast or ring; the ranks
    agreed it is the same everywhere), ``spans_hosts`` whether the group's host
    keys differ. The ring takes only dtypes every gloo release's collectives accept
    (gloo's point-to-point transfers take any: the broadcasts then keep torch's
    own "Invalid scalar type").
    """
    if route is not BROADCAST:
        return route
    ring = setting == "ring" or (setting == "auto" and spans_hosts)
    return RING if ring and dtype in RING_DTYPES else BROADCAST


def run(
    route: Route, flat: torch.Tensor, tensor: torch.Tensor, group: Any, async_op: bool, released: bool = True
) -> Any:
    """Gather every rank's ``tensor`` into ``flat``; returns what torch would.

    ``released``: a synchronous single call returns only once the backend let go of ``flat``
    (``compat.await_release_of``), where a later proof reads who holds it: an elided cat's, or
    the result of a small ``gather()`` (``planner.small_single``). A rebind's buffer that no cat
    is armed for is never read so (the slots, its views, are adjacent: the next call gathers
    straight into them), and a hold a backend's worker keeps for a moment is as torch's hold of
    its own temporary: the wait is left out.
    """
    if route.in_place:
        world = groups.describe(group).world
        return fill(route, slots.views(flat, world, tensor.shape), tensor, group)
    primitive = compat.single_tensor_primitive().function
    assert primitive is not None  # core falls back (no_primitive) before any route runs
    source = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if route.every_rank and not source.is_contiguous():
        source = source.contiguous()  # no rank may fall back for it: NCCL reads raw memory
    settle = released and not async_op
    held = compat.hold(flat) if settle else None
    # Positional, and the defaults left out where they are the defaults: the wrapper torch puts
    # around its collectives takes measurably longer over keywords, on every rewired call.
    work = primitive(flat, source) if group is None and async_op is False else primitive(flat, source, group, async_op)
    if settle:
        compat.await_release_of(flat, held)
    return work


def fill(route: Route, destinations: List[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
    """Rank i's ``tensor`` into ``destinations[i]`` on every rank, by ``route`` (an in-place one)."""
    (ring_into if route is RING else broadcast_into)(destinations, tensor, group)


def ring_into(destinations: List[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
    """Rank i's ``tensor`` into ``destinations[i]`` on every rank: ``world - 1`` steps around a ring.

    At step s each rank sends part (rank - s) to the next rank and receives part
    (rank - s - 1) from the previous one. The destinations must be contiguous and
    must not overlap one another; their sizes may differ (every rank must pass the same).
    """
    rank = groups.describe(group).rank
    world = len(destinations)
    # A part of no elements travels as one element that nobody reads (an uneven gather's rank with
    # no rows; every rank knows which): every rank posts the same transfers, as torch checks under
    # TORCH_DISTRIBUTED_DEBUG=DETAIL, and gloo never moves an empty tensor.
    sent = [part if part.numel() else part.new_empty(1) for part in _prepare(destinations, tensor, rank)]
    held = compat.holds(sent)
    ranks = _global_ranks(group, world)
    after, before = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
    for step in range(world - 1):
        # The receive first: gloo's TCP transport sends a message only once the receiver has said
        # it is ready for it. Posted after the send, it made the two directions of a link take
        # turns: 2 hosts x 1 rank over 1 Gbit/s, 64 MiB per rank, 1.08-1.25 x torch's time against
        # 0.56-0.67 x (tests.multihost).
        works = [
            dist.irecv(sent[(rank - step - 1) % world], src=before, group=group, tag=RING_TAG),
            dist.isend(sent[(rank - step) % world], dst=after, group=group, tag=RING_TAG),
        ]
        _wait_all(works)  # the next step sends what this one received
    compat.await_release(sent, before=held)


def _prepare(destinations: List[torch.Tensor], tensor: torch.Tensor, rank: int) -> List[torch.Tensor]:
    """The own part in place, and aliases of the destinations that only memgather holds, so that
    waiting for gloo to let go of them never waits on a hold of the caller's. Complex ones are
    sent as real views, as torch's all_gather sends them: gloo on torch 2.0.1 refuses complex dtypes."""
    own = destinations[rank]
    in_place = own.data_ptr() == tensor.data_ptr() and tensor.is_contiguous()
    for index, destination in enumerate(destinations):
        if index != rank or not in_place:  # the caller's own input, where it is the part, is only read
            pages.advise(destination)
    if not in_place:
        own.copy_(tensor)
    return [torch.view_as_real(d) if d.is_complex() else d.detach() for d in destinations]


def broadcast_into(destinations: List[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
    """Rank i's ``tensor`` into ``destinations[i]`` on every rank: one async broadcast each.

    The destinations must be contiguous and must not overlap one another; their sizes may
    differ (every rank must pass the same).
    """
    rank = groups.describe(group).rank
    sent = _prepare(destinations, tensor, rank)
    held = compat.holds(sent)
    ranks = _global_ranks(group, len(destinations))
    # A part of no elements moves nothing (an uneven gather's rank with no rows; every rank knows it).
    works = [dist.broadcast(d, src=ranks[i], group=group, async_op=True) for i, d in enumerate(sent) if d.numel()]
    _wait_all(works)  # which also drops memgather's own hold on the outputs
    compat.await_release(sent, before=held)


def _wait_all(works: list) -> None:
    # Wait for every broadcast even after one failed, so none is still writing
    # into the caller's slots when the exception reaches the caller.
    failure: Optional[BaseException] = None
    for work in works:
        try:
            work.wait()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            failure = failure or error
    works.clear()  # memgather's hold on the outputs ends here, also when a traceback keeps the caller's frame
    if failure is not None:
        raise failure


def _global_ranks(group: Any, world: int) -> list:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(world))
    return list(dist.get_process_group_ranks(group))
