"""The ways in, each run for real in a fresh interpreter: the CLI, the pytest plugin,
pure-Python wrapt, and MEMGATHER=1 through memgather.pth in a real virtual environment."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

from tests.jobs import environment

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _run(args: List[str], env: Dict[str, str] = None, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=environment(**(env or {})), cwd=cwd, timeout=timeout)


def test_cli_run_sets_the_environment_and_execs() -> None:
    done = _run([PYTHON, "-m", "memgather", "run", "--targets", "accelerate", "moco", "--check", "--verify", "--elide", "off", "--",
                 PYTHON, "-c", "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('MEMGATHER')}))"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"MEMGATHER": "1", "MEMGATHER_TARGETS": "accelerate,moco", "MEMGATHER_CHECK": "1",
                                       "MEMGATHER_VERIFY": "1", "MEMGATHER_ELIDE": "0"}


def test_cli_run_errors_name_the_problem() -> None:
    assert _run([PYTHON, "-m", "memgather", "run"]).returncode == 2
    missing = _run([PYTHON, "-m", "memgather", "run", "--", "no-such-command-mg"])
    assert missing.returncode == 127 and "command not found: no-such-command-mg" in missing.stderr


def test_cli_help_lists_the_commands() -> None:
    done = _run([PYTHON, "-m", "memgather", "--help"])
    assert done.returncode == 0 and all(word in done.stdout for word in ("run", "doctor", "bench"))


def test_doctor_reports_and_exits_zero_when_usable() -> None:
    done = _run([PYTHON, "-m", "memgather", "doctor"])
    assert done.returncode == 0, done.stdout + done.stderr
    for expected in ("torch 2.", "single-tensor all-gather: ", "gloo  available: ", "accelerate",
                     "pytorch_lightning", ".pth:", "verdict: usable",
                     "uneven gathers (memgather.gather_uneven): one int64 row per rank exchanged"):
        assert expected in done.stdout


def test_doctor_reports_a_pth_that_names_a_module_memgather_has_not(tmp_path: Path) -> None:
    """An editable install's .pth is a copy: after an upgrade it may import a module that moved."""
    from memgather.tools import doctor

    shipped = (Path(__file__).parent.parent / "memgather.pth").read_text()
    stale = ('import os; os.environ.get("MEMGATHER", "").strip() not in ("", "0") and '
             '__import__("memgather._autoload")\n')
    found = {}
    # As site reads a .pth: only lines starting with "import" run; others are paths or comments.
    for name, text in {"shipped": shipped, "statement": "import memgather.patching.autoload\n",
                       "commented": '# __import__("memgather._autoload")\n' + shipped, "empty": "",
                       "stale": stale, "stale statement": "import memgather._autoload\n"}.items():
        (tmp_path / name).write_text(text)
        found[name] = doctor.pth_stale(str(tmp_path / name))
    (tmp_path / "bytes").write_bytes(b"\xff\xfe\n")
    found["bytes"] = doctor.pth_stale(str(tmp_path / "bytes"))
    said = "it imports memgather._autoload, which this memgather has not: reinstall memgather (pip install -e . in a checkout)"
    assert found == {"shipped": None, "statement": None, "commented": None, "empty": None, "bytes": None,
                     "stale": said, "stale statement": said}


def test_doctor_states_the_gloo_threshold_in_force() -> None:
    done = _run([PYTHON, "-m", "memgather", "doctor"], env={"MEMGATHER_GLOO_MIN_BYTES": str(4 << 20)})
    assert done.returncode == 0 and "gloo  available: sync calls from 4 MiB per rank" in done.stdout, done.stdout


def test_doctor_names_an_invalid_setting() -> None:
    done = _run([PYTHON, "-m", "memgather", "doctor"], env={"MEMGATHER_CHECK": "maybe"})
    assert done.returncode == 1 and "MEMGATHER_CHECK='maybe' is not a boolean" in done.stdout


def test_pytest_plugin_patches_an_unedited_suite(tmp_path: Path) -> None:
    (tmp_path / "test_legacy.py").write_text(textwrap.dedent(
        """
        import os
        import memgather

        def test_runs_patched():
            assert memgather.is_patched()
            assert os.environ["MEMGATHER_TARGETS"] == "legacy_pkg"
            assert os.environ["MEMGATHER_CHECK"] == "1"
        """
    ))
    done = _run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "--memgather", "--memgather-targets", "legacy_pkg",
                 "--memgather-check", str(tmp_path / "test_legacy.py")], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memgather: patched for legacy_pkg" in done.stdout
    inert = _run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path / "test_legacy.py")], cwd=tmp_path)
    assert inert.returncode == 1  # without --memgather nothing is patched


SCOPED_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {root!r})
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import memgather, wrapt
    from benchmarks.overhead import treat_fake_as_legacy_nccl
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    treat_fake_as_legacy_nccl()  # memgather has no route for the fake backend: legacy NCCL's, in this process
    memgather.patch(["tests.sites.target_caller"])
    from tests.sites import other_caller, target_caller
    counts = []
    for module in (target_caller, other_caller, target_caller):
        memgather.reset_stats()
        module.gather(torch.ones(3))
        counts.append(memgather.stats().rewired)
    base = type(dist.all_gather).__mro__[1]
    print(json.dumps({{"counts": counts, "c_extension": base.__module__ == "_wrappers"}}))
    """
)


@pytest.mark.parametrize("pure_python", [False, True], ids=["wrapt-c-extension", "wrapt-pure-python"])
def test_caller_scoping_with_and_without_wrapts_extension(pure_python: bool) -> None:
    # The fake backend, given legacy NCCL's route: its threshold would leave these 12-byte gathers to torch.
    # TORCH_DISTRIBUTED_DEBUG off: torch cannot wrap the fake backend for DETAIL's checks.
    env = {"MEMGATHER_NCCL_MIN_BYTES": "0", "TORCH_DISTRIBUTED_DEBUG": "OFF",
           **({"WRAPT_DISABLE_EXTENSIONS": "1"} if pure_python else {})}
    done = _run([PYTHON, "-c", SCOPED_SCRIPT.format(root=str(ROOT))], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["c_extension"] is not pure_python
    assert result["counts"] == [1, 0, 1]


def test_memgather_log_sends_messages_to_stderr() -> None:
    script = "import memgather; memgather.patch(['mypkg']); memgather.unpatch()"
    done = _run([PYTHON, "-c", script], env={"MEMGATHER_LOG": "INFO"})
    assert done.returncode == 0, done.stderr
    assert "[memgather] INFO memgather patched all_gather for mypkg" in done.stderr
    quiet = _run([PYTHON, "-c", script])
    assert "memgather patched" not in quiet.stderr


def test_a_bad_log_level_is_named() -> None:
    done = _run([PYTHON, "-c", "import memgather; memgather.patch()"], env={"MEMGATHER_LOG": "LOUD"})
    assert done.returncode == 1 and "MEMGATHER_LOG='LOUD' is not a logging level" in done.stderr


def test_bench_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = _run([PYTHON, "-m", "memgather", "bench", "--shape", "1024,1024", "--repeat", "1",
                 "--patterns", "empty_like_cat,views_in_place", "--json", str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[bench] empty_like + cat" in done.stdout and "identical" in done.stdout
    rows = json.loads(out.read_text())
    assert [row["pattern"] for row in rows] == ["empty_like_cat", "views_in_place"]
    for row in rows:
        assert row["identical"] and row["bytes_per_rank"] == 4 << 20
        assert row["peak_memgather"] < row["peak_torch"]  # 4 MiB per rank: rewired, the temporary saved


@pytest.mark.parametrize("args,message", [
    (["--shape", "1024,x"], "--shape '1024,x': expected comma-separated integers"),
    (["--shape", "0"], "every dimension must be positive"),
    (["--patterns", "nope"], "unknown pattern(s) nope"),
])
def test_bench_names_bad_options(args: List[str], message: str) -> None:
    done = _run([PYTHON, "-m", "memgather", "bench", *args])
    assert done.returncode == 2 and message in done.stderr


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert f"    {ci}\n" in readme, "the README's test command and .ci/run have drifted apart"
    assert ci.endswith("&& .venv/bin/ruff check && .venv/bin/ruff format --check && .venv/bin/mypy "
                       "&& .venv/bin/python -m pytest && .venv/bin/tox -m ci --discard")


def test_every_torch_release_environment_is_a_measured_release() -> None:
    import configparser

    from tests.releases import MEASURED

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    releases = {name.split(":", 1)[1]: tox[name] for name in tox.sections()
                if name.startswith("testenv:") and "torch-releases" in tox[name].get("labels", "")}
    pinned = {}
    for name, env in releases.items():
        torch_pin = next(line.strip() for line in env["deps"].splitlines() if line.strip().startswith("torch=="))
        pinned[name] = tuple(int(part) for part in torch_pin.split("==")[1].split(".")[:2])
        assert env["commands"] == "{[releases]commands}" and env["package"] == "wheel", name
    assert set(pinned.values()) == set(MEASURED)
    assert pinned["torch2.13"] == (2, 13)
    assert all("ci" not in env["labels"] for env in releases.values())  # the unit suite runs them on 2.13


def test_bench_digest_needs_no_numpy() -> None:
    """The main job's venv has torch alone; torch's .numpy() would fail there."""
    script = ("import sys; sys.modules['numpy'] = None\n"
              "import hashlib, torch\n"
              "from memgather.tools import bench\n"
              "parts = [torch.arange(6.0).reshape(2, 3).t(), torch.tensor(7, dtype=torch.int16), torch.empty(0)]\n"
              "want = hashlib.sha256(b''.join(bytes(p.contiguous().reshape(-1).view(torch.uint8).tolist()) for p in parts))\n"
              "assert bench.digest(parts) == want.hexdigest()\n"
              "assert bench.digest(parts[0]) == hashlib.sha256(bytes(parts[0].contiguous().reshape(-1).view(torch.uint8).tolist())).hexdigest()\n")
    done = _run([PYTHON, "-c", script])
    assert done.returncode == 0, done.stderr[-3000:]
