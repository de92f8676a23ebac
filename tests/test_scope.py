"""memgather.disabled(): confined to its thread or asyncio task, nestable, a decorator too."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import memgather
from memgather.patching.scope import is_disabled


def test_context_manager_nests() -> None:
    assert not is_disabled()
    with memgather.disabled():
        assert is_disabled()
        with memgather.disabled():
            assert is_disabled()
        assert is_disabled()
    assert not is_disabled()


def test_decorator_applies_per_call_and_survives_recursion() -> None:
    seen = []

    @memgather.disabled()
    def walk(depth: int) -> None:
        seen.append(is_disabled())
        if depth:
            walk(depth - 1)

    walk(3)
    assert seen == [True] * 4 and not is_disabled()


def test_confined_to_its_thread() -> None:
    inside, entered, release = [], threading.Event(), threading.Event()

    def opted_out() -> None:
        with memgather.disabled():
            entered.set()
            release.wait(60)
            inside.append(is_disabled())

    thread = threading.Thread(target=opted_out)
    thread.start()
    assert entered.wait(60)
    assert not is_disabled()  # the other thread's opt-out does not leak here
    release.set()
    thread.join(60)
    assert inside == [True]


def test_confined_to_its_asyncio_task() -> None:
    async def opted_out(flag: asyncio.Event) -> bool:
        with memgather.disabled():
            flag.set()
            await asyncio.sleep(0)
            return is_disabled()

    async def bystander(flag: asyncio.Event) -> bool:
        await flag.wait()
        return is_disabled()

    async def main() -> list:
        flag = asyncio.Event()
        return await asyncio.gather(opted_out(flag), bystander(flag))

    assert asyncio.run(main()) == [True, False]


def test_exception_inside_restores_state() -> None:
    try:
        with memgather.disabled():
            raise KeyError("x")
    except KeyError:
        pass
    assert not is_disabled()


def test_the_opt_out_imports_nothing_heavy() -> None:
    """A decorator applied at import time: ``memgather.disabled`` must not pull torch in."""
    code = "import sys, memgather; memgather.disabled; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
