"""MEMGATHER=1 through memgather.pth, in a real virtual environment with memgather
installed from its wheel (not editable), running a real 2-process gloo job."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from tests.jobs import JOB, environment, launch, run_job

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv: memgather from a freshly built wheel; torch & co. from this
    environment's site-packages, added as a plain path (its .pth files stay unprocessed), named to come before memgather.pth as site-packages order would have it."""
    base = tmp_path_factory.mktemp("pth")
    wheels = base / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("memgather-*.whl"))
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    (site / "aa_outer_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield python


def test_the_wheel_carries_the_pth(venv: Path) -> None:
    site = next(venv.parent.parent.glob("lib/python*/site-packages"))
    assert (site / "memgather.pth").read_text().startswith("import os;")
    assert not (site / "memgather" / "__init__.py").is_symlink()


def test_memgather_1_rewires_target_callers_only(venv: Path) -> None:
    for rank in run_job(venv, MEMGATHER="1", MEMGATHER_TARGETS="mgtarget", MEMGATHER_REPORT="all"):
        assert rank["patched"] and "site-packages" in rank["memgather_file"]
        assert rank["target"] == 1 and rank["other"] == 0
        assert rank["target_correct"] and rank["other_correct"]


def test_unset_nothing_is_patched(venv: Path) -> None:
    for rank in run_job(venv):
        assert not rank["patched"] and rank["target"] == 0


def test_kill_switch_beats_patch_in_code(venv: Path) -> None:
    for rank in run_job(venv, MEMGATHER="0", CALL_PATCH="1", MEMGATHER_TARGETS="mgtarget"):
        assert not rank["patched"] and rank["target"] == 0 and rank["target_correct"]


def test_report_at_exit(venv: Path) -> None:
    done = launch(venv, MEMGATHER="1", MEMGATHER_TARGETS="mgtarget", MEMGATHER_REPORT="all")
    assert "[memgather rank 0] memgather:" in done.stderr and "[memgather rank 1] memgather:" in done.stderr


def test_pth_processed_twice_is_harmless(venv: Path) -> None:
    site = next(venv.parent.parent.glob("lib/python*/site-packages"))
    script = f"import site; site.addsitedir({str(site)!r}); import torch.distributed as dist, memgather; print(type(dist.all_gather).__mro__[0].__name__, memgather.is_patched())"
    done = subprocess.run([str(venv), "-c", script], capture_output=True, text=True, env=environment(MEMGATHER="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["MemgatherWrapper", "True"]


@pytest.mark.parametrize("imports", [
    "import memgather; memgather.is_patched()",  # the patcher's own import brings torch in
    "from memgather import all_gather",  # the engine's does
    "import memgather.engine.core",
    "import memgather.compat",
])
def test_memgather_imported_before_torch_patches_once_its_import_ends(venv: Path, imports: str) -> None:
    """torch's import ends inside one of memgather's modules: the patch waits for memgather's
    import to end instead of failing on a half-initialised module."""
    script = f"{imports}\nimport torch.distributed as dist\nprint(type(dist.all_gather).__name__)"
    done = subprocess.run([str(venv), "-c", script], capture_output=True, text=True, env=environment(MEMGATHER="1"),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not patch" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.split()[-1:] == ["MemgatherWrapper"]


def _run(venv: Path, script: str, cwd: Optional[Path] = None, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv), *args] if args else [str(venv), "-c", script], capture_output=True, text=True,
                          env=environment(MEMGATHER="1", **env), cwd=cwd, timeout=300)


@pytest.mark.parametrize("first", ["test_first.py", "conftest.py"])
@pytest.mark.parametrize("options", [[], ["--memgather"]])
def test_memgather_imported_before_torch_by_a_test_module_under_pytest(venv: Path, tmp_path: Path,
                                                                        options: List[str], first: str) -> None:
    """pytest's finder goes in front of every other: memgather's imports by a conftest, a test
    module, or ``--memgather``'s own patch(), must still be seen to end before the start-up patch runs."""
    (tmp_path / first).write_text("import memgather\nmemgather.is_patched()\n")
    (tmp_path / "test_patched.py").write_text("import memgather\nmemgather.is_patched()\n"
                                              "import torch.distributed as dist\n\n\n"
                                              "def test_patched():\n"
                                              "    assert type(dist.all_gather).__name__ == 'MemgatherWrapper'\n")
    done = _run(venv, "", tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", *options)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "could not patch" not in done.stdout + done.stderr


def test_memgather_imported_by_two_threads_at_once_patches_after_both(venv: Path) -> None:
    script = textwrap.dedent("""
        import threading, time
        def patcher(): import memgather.patching.patcher  # brings torch in
        def compat(): import memgather.compat  # begun while the other is importing torch
        threads = [threading.Thread(target=patcher), threading.Thread(target=compat)]
        threads[0].start(); time.sleep(0.2); threads[1].start()
        for thread in threads: thread.join()
        import torch.distributed as dist
        print(type(dist.all_gather).__name__)
    """)
    done = _run(venv, script)
    assert done.returncode == 0 and "could not patch" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.split()[-1:] == ["MemgatherWrapper"]


def test_a_reloaded_autoload_installs_nothing_twice(venv: Path) -> None:
    script = textwrap.dedent("""
        import importlib, sys
        import memgather.patching.autoload as autoload
        importlib.reload(autoload)
        watches = sum(type(f).__name__ == "_Watch" for f in sys.meta_path)
        import torch.distributed as dist
        print(watches, type(dist.all_gather).__name__, sum(type(f).__name__ == "_Watch" for f in sys.meta_path))
    """)
    done = _run(venv, script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["1", "MemgatherWrapper", "0"]  # one watch, gone once patched


def test_a_memgather_import_that_fails_after_torch_came_in_says_so_at_once(venv: Path) -> None:
    """As before memgather's imports were watched: the failure is logged then, and the patch does
    not go off later at some other import."""
    script = textwrap.dedent("""
        import sys
        sys.modules["packaging.version"] = None  # compat imports it after torch
        try:
            import memgather.compat
        except ImportError:
            pass
        del sys.modules["packaging.version"]
        import torch.distributed as dist
        before = type(dist.all_gather).__name__
        import memgather.engine.reasons
        print(before, type(dist.all_gather).__name__, any(type(f).__name__ == "_Watch" for f in sys.meta_path))
    """)
    done = _run(venv, script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "memgather could not patch at start-up" in done.stderr
    assert done.stdout.split()[-3:] == ["function", "function", "False"]


def test_a_failed_engine_import_leaves_torch_whole(venv: Path) -> None:
    """The engine's import fails after torch came in: the patch must not import the half-run
    module (it would install a wrapper around an engine without its functions)."""
    script = textwrap.dedent("""
        import sys, tempfile
        sys.modules["memgather.engine.verification"] = None  # core imports it after torch
        try:
            from memgather import all_gather
        except ImportError:
            pass
        del sys.modules["memgather.engine.verification"]
        import torch, torch.distributed as dist, memgather
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        slots = [torch.empty(2)]
        dist.all_gather(slots, torch.ones(2))
        print(memgather.is_patched(), type(dist.all_gather).__name__, slots[0].tolist())
    """)
    done = _run(venv, script, MEMGATHER_TARGETS="__main__")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the import of memgather.engine.core failed" in done.stderr
    assert done.stdout.split()[-4:] == ["False", "function", "[1.0,", "1.0]"]


def test_autoload_imported_afresh_after_memgather_was_dropped_keeps_one_watch(venv: Path) -> None:
    script = textwrap.dedent("""
        import sys
        for name in [n for n in sys.modules if n == "memgather" or n.startswith("memgather.")]:
            del sys.modules[name]
        import memgather.patching.autoload
        watches = sum(type(f).__name__ == "_Watch" for f in sys.meta_path)
        from memgather import all_gather
        import torch.distributed as dist
        print(watches, type(dist.all_gather).__name__)
    """)
    done = _run(venv, script)
    assert done.returncode == 0 and "could not patch" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["1", "MemgatherWrapper"]


def test_memgather_run_in_front_of_torchrun(venv: Path) -> None:
    command = [str(venv), "-m", "memgather", "run", "--targets", "mgtarget", "--report", "all", "--",
               str(venv), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "torchrun_job.py"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=JOB, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        # mgtarget.gather returns its fresh list to code not proven to concatenate it at once: never
        # armed, its slots filled where they lie.
        assert f"[memgather rank {rank}] memgather: 1 calls, 1 rewired (in_slots=1)" in done.stderr
    assert done.stderr.count("[memgather rank") == 2  # the launcher is not a rank: no line of its own
