"""torch's object collectives from a target, memgather's way against torch's, bit for bit, on real gloo ranks.

Each program runs every collective twice on the same ranks: unpatched, then with memgather
patched for ``tests.sites.object_calls``; what each rank observes (the objects in its list:
types, structure, every tensor's dtype, shape, strides, ``requires_grad`` and bytes; the errors
raised, by type and message; how often the unpickler ran) must be the same, and the call must
have been memgather's (``object_parts``). The kinds of objects: tensors (views, non-contiguous,
requiring grad, of every dtype), nested containers, strings, bytes, empty objects, None, and a
rank with a tiny object beside a huge one. Also under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, whose
check of every rank's collectives fails a rank that took another route.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from tests.conftest import EAGER, unwrap

DETAIL = {"POOL": "detail", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_PARTS = {**DETAIL, **EAGER}  # every part on its own, however small


def _kinds(rank: int) -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(rank)
    base = torch.rand(6, 5, generator=generator)
    return {
        "tensor": torch.rand(3, 4, generator=generator),
        "view_and_strides": [base.t(), base[1:4, ::2], base],
        "requires_grad": torch.rand(4, generator=generator).requires_grad_(),
        "dtypes": [torch.arange(5, dtype=d) for d in (torch.uint8, torch.int64, torch.float16, torch.bfloat16)]
        + [torch.tensor([True, False]), torch.complex(base, base)],
        "nested": {"a": [1, (2.5, "x" * rank)], "b": {"c": torch.ones(2) * rank, "d": None}},
        "string": "rank" * (rank + 1),
        "bytes": bytes(range(rank + 3)),
        "empty_list": [],
        "empty_dict": {},
        "none": None,
        "zero_size_tensor": torch.empty(0, 3),
        "tiny_beside_huge": 7 if rank % 2 else torch.rand(1 << 19, generator=generator),
        "eval_results": [
            {"image_id": rank * 100 + i, "boxes": torch.rand(50, 4, generator=generator), "labels": torch.arange(50)}
            for i in range(20 * (rank + 1))
        ],
    }


def _describe(value: Any) -> Any:
    """What a caller can observe of an unpickled object, as plain data."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().view(torch.uint8) if value.numel() else value.detach()
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.stride(),
            value.requires_grad,
            value.is_leaf,
            bytes(data.numpy().tobytes()) if value.numel() else b"",
        )
    if isinstance(value, dict):
        return ("dict", [(_describe(k), _describe(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(v) for v in value])
    return (type(value).__name__, repr(value))


def _outcome(call: Any) -> Any:
    try:
        return ("returned", _describe(call()))
    except Exception as error:  # noqa: BLE001 - compared, torch's against memgather's
        return ("raised", type(error).__name__, str(error))


def _both_ways(run: Any) -> Dict[str, Any]:
    """``run()`` unpatched and patched for the target; what each observed, and what memgather did."""
    import memgather

    torch_way = run()
    memgather.reset_stats()
    memgather.patch(["tests.sites.object_calls"])
    try:
        ours = run()
    finally:
        memgather.unpatch()
    stats = memgather.stats()
    return {
        "torch": torch_way,
        "memgather": ours,
        "by_strategy": dict(stats.by_strategy),
        "fallbacks": dict(stats.fallbacks),
    }


def object_programs(ctx: Any) -> Dict[str, Any]:
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    out: Dict[str, Any] = {}
    for name, obj in _kinds(rank).items():

        def gather_all(obj: Any = obj) -> Any:
            listed: List[Any] = [None] * world
            object_calls.all_gather_object(listed, obj)
            return listed

        def gather_to_last(obj: Any = obj) -> Any:
            listed = [None] * world if rank == world - 1 else None
            object_calls.gather_object(obj, listed, dst=world - 1)
            return listed

        def broadcast_from_1(obj: Any = obj, name: str = name) -> Any:
            listed = [obj, name, None] if rank == 1 else [None, None, None]
            object_calls.broadcast_object_list(listed, src=1)
            return listed

        for collective, run in (
            ("all_gather_object", gather_all),
            ("gather_object", gather_to_last),
            ("broadcast_object_list", broadcast_from_1),
        ):
            out[f"{collective}:{name}"] = _both_ways(lambda run=run: _outcome(run))
    return out


@pytest.mark.parametrize(
    "world,env",
    [(2, EAGER), (3, EAGER), (2, DETAIL_PARTS), (2, {}), (3, DETAIL)],
    ids=["2_ranks", "3_ranks", "2_ranks_detail", "2_ranks_small_padded", "3_ranks_small_padded_detail"],
)
def test_each_kind_of_object_is_what_torch_gives(pools: Any, world: int, env: Dict[str, str]) -> None:
    """By parts (no threshold), and with gloo's default threshold, under which all_gather_object's
    small parts go in one padded gather (the other two collectives' always by parts)."""
    for rank, results in enumerate(unwrap(pools(world, **env).run(object_programs))):
        for case, got in results.items():
            assert got["memgather"] == got["torch"], (rank, case)
            assert got["torch"][0] == "returned", (rank, case, got["torch"])
            small = case.startswith("all_gather_object:") and env.get("MEMGATHER_GLOO_MIN_BYTES") != "0"
            padded = small and not case.endswith("tiny_beside_huge")  # (its huge part is past 2 MiB)
            assert got["by_strategy"] == {"object_padded" if padded else "object_parts": 1}, (rank, case, got)


class _Refusing(pickle.Unpickler):
    """An unpickler restricted as users restrict theirs: no torch storages, and a count of its loads."""

    loads = 0

    def __init__(self, file: Any) -> None:
        type(self).loads += 1
        super().__init__(file)

    def find_class(self, module: str, name: str) -> Any:
        if name == "_load_from_bytes":
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here")
        return super().find_class(module, name)


def replaced_unpickler(ctx: Any) -> Dict[str, Any]:
    """With ``distributed_c10d._unpickler`` replaced: the loads it makes, and the error it raises where a
    rank's part holds what it refuses (the objects read before it are in the list, as torch's are)."""
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    c10d = dist.distributed_c10d
    original = c10d._unpickler
    c10d._unpickler = _Refusing
    try:

        def run(obj: Any) -> Any:
            listed: List[Any] = ["untouched"] * world
            _Refusing.loads = 0
            outcome = _outcome(lambda: object_calls.all_gather_object(listed, obj))
            return outcome, _describe(listed), _Refusing.loads

        return {
            "allowed": _both_ways(lambda: run({"rank": rank, "s": "x" * rank})),
            "refused_on_the_last_rank": _both_ways(lambda: run(torch.ones(2) if rank == world - 1 else rank)),
        }
    finally:
        c10d._unpickler = original


@pytest.mark.parametrize("world,env", [(2, {}), (3, DETAIL)], ids=["2_ranks", "3_ranks_detail"])
def test_the_unpickler_torch_would_use_is_the_one_that_runs(pools: Any, world: int, env: Dict[str, str]) -> None:
    for rank, results in enumerate(unwrap(pools(world, **env).run(replaced_unpickler))):
        for case, got in results.items():
            assert got["memgather"] == got["torch"], (rank, case, got)
        outcome, listed, loads = results["refused_on_the_last_rank"]["memgather"]
        assert outcome[0] == "raised" and outcome[1] == "UnpicklingError" and loads == world, (rank, outcome)
        assert listed[1][-1] == ("str", "'untouched'"), (rank, listed)  # the part that raised was not placed


def pickling_fails_on_one_rank(ctx: Any) -> Dict[str, Any]:
    """torch leaves the other ranks waiting for ever here; memgather raises on every rank, at once."""
    import memgather
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    memgather.patch(["tests.sites.object_calls"])
    try:
        obj = (lambda: 0) if rank == 1 else {"rank": rank}
        listed: List[Any] = [None] * world
        outcome = _outcome(lambda: object_calls.all_gather_object(listed, obj))
        after: List[Any] = [None] * world
        object_calls.all_gather_object(after, rank)  # the group goes on as before
        return {"outcome": outcome[:2], "after": after, "ranks": outcome[2] if rank != 1 else None}
    finally:
        memgather.unpatch()


def test_an_object_that_fails_to_pickle_raises_on_every_rank(pools: Any) -> None:
    for rank, got in enumerate(unwrap(pools(3, **DETAIL).run(pickling_fails_on_one_rank))):
        assert got["after"] == [0, 1, 2], (rank, got)
        if rank == 1:
            with pytest.raises(Exception) as raised:
                pickle.dumps(lambda: 0)
            assert got["outcome"] == ("raised", type(raised.value).__name__), got
        else:
            assert got["outcome"] == ("raised", "ObjectPickleError"), got
            assert "group rank(s) 1 failed to pickle" in got["ranks"], got


def errors_and_groups(ctx: Any) -> Dict[str, Any]:
    """Errors torch raises, subgroups, roots named by group rank, and a caller that is not a target."""
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    pair = dist.new_group([2, 0])  # (every rank makes the group; rank 1 is not in it)
    cases = {
        "short_list": lambda: _both_ways(lambda: _outcome(lambda: _short(object_calls, rank))),
        # (torch raises before any collective, on each rank that is wrong: here every rank is)
        "lists_wrong_on_every_rank": lambda: _both_ways(
            lambda: _outcome(lambda: object_calls.gather_object(rank, None if rank == 0 else [None] * world, dst=0))
        ),
        "subgroup_all_gather": lambda: _both_ways(lambda: _outcome(lambda: _in_pair(object_calls, pair, rank))),
        "subgroup_gather_by_group_rank": lambda: _both_ways(
            lambda: _outcome(lambda: _gather_in_pair(object_calls, pair, rank))
        ),
        "subgroup_broadcast_by_global_rank": lambda: _both_ways(
            lambda: _outcome(lambda: _broadcast_in_pair(object_calls, pair, rank))
        ),
        "not_a_target": lambda: _both_ways(lambda: _outcome(lambda: _not_a_target(rank, world))),
    }
    return {name: run() for name, run in cases.items()}


def _short(object_calls: Any, rank: int) -> Any:
    listed: List[Any] = [None]
    object_calls.all_gather_object(listed, {"rank": rank})
    return listed


def _in_pair(object_calls: Any, pair: Any, rank: int) -> Any:
    listed: List[Any] = [None, None]
    object_calls.all_gather_object(listed, [rank] * (rank + 1), group=pair)
    return listed


def _gather_in_pair(object_calls: Any, pair: Any, rank: int) -> Any:
    listed = [None, None] if rank == 2 else None  # (torch sorts a group's ranks: group rank 1 is global rank 2)
    object_calls.gather_object(str(rank), listed, group_dst=1, group=pair)
    return listed


def _broadcast_in_pair(object_calls: Any, pair: Any, rank: int) -> Any:
    listed = [torch.arange(3), {"x": 1}] if rank == 2 else [None, None]
    object_calls.broadcast_object_list(listed, src=2, group=pair)
    return listed


def _not_a_target(rank: int, world: int) -> Any:
    listed: List[Any] = [None] * world
    dist.all_gather_object(listed, rank)
    return listed


def test_torchs_errors_subgroups_and_other_callers(pools: Any) -> None:
    for rank, results in enumerate(unwrap(pools(3, **DETAIL_PARTS).run(errors_and_groups))):
        for case, got in results.items():
            assert got["memgather"] == got["torch"], (rank, case, got)
        assert results["short_list"]["torch"][:2] == ("raised", "IndexError"), results["short_list"]
        assert results["lists_wrong_on_every_rank"]["torch"][:2] == ("raised", "ValueError"), results
        assert results["not_a_target"]["by_strategy"] == {}, results["not_a_target"]
        for case in ("subgroup_all_gather", "subgroup_gather_by_group_rank", "subgroup_broadcast_by_global_rank"):
            strategy = results[case]["by_strategy"]
            assert strategy == ({"fallback": 1} if rank == 1 else {"object_parts": 1}), (rank, case, results[case])
            assert results[case]["fallbacks"] == ({"not_in_group": 1} if rank == 1 else {}), (rank, case)


def a_mode_on_one_rank(ctx: Any) -> Dict[str, Any]:
    """A dispatch mode on rank 0 only: every rank takes torch's way (the mode sees torch's operations)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()

    class Counting(TorchDispatchMode):
        ops: List[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def run() -> Any:
        listed: List[Any] = [None] * world
        Counting.ops = []
        if rank == 0:
            with Counting():
                object_calls.all_gather_object(listed, {"rank": rank})
        else:
            object_calls.all_gather_object(listed, {"rank": rank})
        return _describe(listed), list(Counting.ops)

    return _both_ways(run)


def test_a_mode_on_one_rank_sends_every_rank_torchs_way(pools: Any) -> None:
    for rank, got in enumerate(unwrap(pools(2, **DETAIL).run(a_mode_on_one_rank))):
        assert got["memgather"] == got["torch"], (rank, got)
        # (torch's own call then makes its size and bytes exchanges through memgather's all_gather wrapper)
        assert got["fallbacks"].get("dispatch_mode", 0) >= 1 and "object_parts" not in got["by_strategy"], (rank, got)


def test_a_read_back_part_is_read_from_its_own_bytes_without_a_copy() -> None:
    """The reader hands the unpickler what it asks for, and nothing more, from the memory it is given."""
    from memgather.engine.object_bytes import BytesView

    payload = {"a": torch.arange(10), "text": "line one\nline two\n", "n": list(range(1000))}
    stream = io.BytesIO()
    pickle.Pickler(stream, protocol=0).dump(["protocol 0 reads lines", 1.5])
    for protocol_stream in (stream, io.BytesIO(pickle.dumps(payload))):
        data = bytearray(protocol_stream.getvalue())
        reader = BytesView(memoryview(data))
        assert _describe(pickle.Unpickler(reader).load()) == _describe(pickle.loads(bytes(data)))
        assert reader.tell() == len(data) and reader.read() == b""
    reader = BytesView(memoryview(bytearray(b"ab\ncd")))
    assert (reader.readline(), reader.peek(1), reader.read(1), reader.readline(), reader.seek(-2, io.SEEK_END)) == (
        b"ab\n",
        b"c",
        b"c",
        b"d",
        3,
    )
    target = bytearray(4)
    assert reader.readinto(target) == 2 and bytes(target[:2]) == b"cd" and reader.getvalue() == b"ab\ncd"
    with pytest.raises(ValueError):
        reader.seek(-1)
    reader.close()
    with pytest.raises(ValueError):
        reader.read()


def verified(ctx: Any) -> Dict[str, Any]:
    """Verify mode: each collective checked against torch's own call; a difference on one rank raises on all."""
    import memgather
    from memgather.engine import objects
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    memgather.patch(["tests.sites.object_calls"], verify=True)
    memgather.reset_stats()
    try:
        listed: List[Any] = [None] * world
        object_calls.all_gather_object(listed, {"rank": rank, "t": torch.ones(3) * rank})
        gathered = [None] * world if rank == 0 else None
        object_calls.gather_object(str(rank), gathered, dst=0)
        broadcast = [rank, None] if rank == 1 else [None, None]
        object_calls.broadcast_object_list(broadcast, src=1)
        clean = memgather.stats().verified
        real = objects.unpickled
        if rank == 1:  # a fault on one rank: its second part read back as something else
            objects.unpickled = lambda view: "not what was sent" if bytes(view) == real_bytes else real(view)
        import io

        stream = io.BytesIO()
        dist.distributed_c10d._pickler(stream).dump(0)
        real_bytes = stream.getvalue()
        try:
            outcome = _outcome(lambda: object_calls.all_gather_object([None] * world, rank))
        finally:
            objects.unpickled = real
        return {"clean": clean, "faulty": outcome[:2]}
    finally:
        memgather.unpatch()


def test_verify_mode_checks_each_collective_and_raises_on_every_rank(pools: Any) -> None:
    for rank, got in enumerate(unwrap(pools(2, **DETAIL).run(verified))):
        assert got == {"clean": 3, "faulty": ("raised", "ObjectVerifyError")}, (rank, got)


def test_what_the_default_unpickler_has_read_is_handed_back_as_it_goes() -> None:
    """Python's own Unpickler reads forwards only: the pages it read are released (they read as zeros
    after), and the object is whole; a reader that may go back (seek) is refused once it releases."""
    from memgather.engine import object_bytes

    payload = [{"i": i, "t": torch.full((2048,), float(i))} for i in range(1024)]  # about 8 MiB pickled
    data = bytearray(pickle.dumps(payload))
    view = memoryview(data)
    loaded = object_bytes.unpickled(view)
    assert _describe(loaded) == _describe(payload)
    import mmap

    released = data[2 * mmap.PAGESIZE : len(data) // 2]  # (whole pages only: the buffer need not start on one)
    assert released.count(0) == len(released), "the first half, read, is back with the system"
    reader = object_bytes.BytesView(memoryview(bytearray(pickle.dumps(payload))), release_behind=True)
    assert not reader.seekable()
    reader.read(9 << 20)
    with pytest.raises(io.UnsupportedOperation):
        reader.seek(0)
    with pytest.raises(io.UnsupportedOperation):
        reader.getvalue()


def under_a_default_device(ctx: Any) -> Dict[str, Any]:
    """torch's own default-device mode (``with torch.device(...)``) on one rank is no reason to step aside."""
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()

    def run() -> Any:
        listed: List[Any] = [None] * world
        if rank == 0:
            with torch.device("cpu"):
                object_calls.all_gather_object(listed, {"rank": rank, "t": torch.ones(2)})
        else:
            object_calls.all_gather_object(listed, {"rank": rank, "t": torch.ones(2)})
        return _describe(listed)

    return _both_ways(run)


def test_a_default_device_is_no_mode_to_step_aside_for(pools: Any) -> None:
    for rank, got in enumerate(unwrap(pools(2, **DETAIL_PARTS).run(under_a_default_device))):
        assert got["memgather"] == got["torch"], (rank, got)
        assert got["by_strategy"] == {"object_parts": 1} and got["fallbacks"] == {}, (rank, got)


class _Plain:
    """An object with no ``__eq__`` of its own: verify mode compares what it pickles."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _counting_unpickler() -> Any:
    class Counting(pickle.Unpickler):
        loads = 0

        def __init__(self, file: Any) -> None:
            type(self).loads += 1
            super().__init__(file)

    return Counting


def awkward_calls(ctx: Any) -> Dict[str, Any]:
    """Verify mode over objects it cannot compare byte for byte; many small objects broadcast; a root
    outside the group; lists that cannot take every object (the unpickler runs as often as torch's)."""
    import memgather
    from tests.sites import object_calls

    world, rank = dist.get_world_size(), dist.get_rank()
    c10d = dist.distributed_c10d
    out: Dict[str, Any] = {}
    sparse = torch.eye(3).to_sparse()
    quantized = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
    memgather.patch(["tests.sites.object_calls"], verify=True)
    try:
        for name, obj in (("sparse", sparse), ("quantized", quantized), ("meta", torch.empty(2, device="meta")),
                          ("plain_class", _Plain([rank, "x"]))):
            listed: List[Any] = [None] * world
            out[f"verify_all_gather:{name}"] = _outcome(lambda: (object_calls.all_gather_object(listed, obj), 0)[1])
            gathered = [None] * world if rank == 0 else None
            out[f"verify_gather:{name}"] = _outcome(lambda: (object_calls.gather_object(obj, gathered, dst=0), 0)[1])
            out[f"after:{name}"] = _outcome(lambda: _not_a_target(rank, world))  # the group still in step
    finally:
        memgather.unpatch()

    def many() -> Any:
        listed = [{"i": i, "s": "x" * (i % 7)} for i in range(500)] if rank == 0 else [None] * 500
        object_calls.broadcast_object_list(listed, src=0)
        return listed

    out["many_small"] = _both_ways(lambda: _outcome(many))
    out["root_past_the_group"] = _both_ways(
        lambda: _outcome(lambda: object_calls.gather_object(rank, None, dst=world)))
    out["source_past_the_group"] = _both_ways(
        lambda: _outcome(lambda: object_calls.broadcast_object_list([rank], src=-1)))
    original = c10d._unpickler
    try:
        for name, make in (("short", lambda: [None]), ("empty", lambda: []), ("tuple", lambda: (None,) * world)):
            def short(make: Any = make) -> Any:
                c10d._unpickler = _counting_unpickler()
                outcome = _outcome(lambda: object_calls.all_gather_object(make(), rank))
                return outcome[:2], c10d._unpickler.loads

            out[f"list_{name}"] = _both_ways(short)
    finally:
        c10d._unpickler = original
    return out


def test_awkward_objects_roots_and_lists_as_torch(pools: Any) -> None:
    for rank, results in enumerate(unwrap(pools(3, **DETAIL_PARTS).run(awkward_calls))):
        for case, got in results.items():
            if case.startswith(("verify_", "after:")):
                assert got == ("returned", ("int", "0")) or case.startswith("after:"), (rank, case, got)
                if case.startswith("after:"):
                    assert got[0] == "returned", (rank, case, got)
                continue
            assert got["memgather"] == got["torch"], (rank, case, got)
        assert results["many_small"]["by_strategy"] == {"object_parts": 1}, results["many_small"]
        assert results["root_past_the_group"]["torch"][0] == "raised", results["root_past_the_group"]
        assert results["list_short"]["torch"][1] == 2, results["list_short"]  # torch stops at the first it cannot place
