"""toxfile.py's --discard, run by real tox: an environment's folder goes once it has passed
with the flag, and stays without it (so a developer's next run reuses it), or when it failed
(its logs are what one reads next)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOX_INI = """[tox]
envlist = small

[testenv:small]
skip_install = true
commands = python -c "open('{marker}', 'w').write('ran')"

[testenv:failing]
skip_install = true
commands = python -c "raise SystemExit(3)"
"""


def _tox(project: Path, *args: str, env: str = "small") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tox", "-e", env, *args], cwd=project, capture_output=True,
                          text=True, timeout=300)


def test_discard_removes_an_environment_once_it_has_run(tmp_path: Path) -> None:
    shutil.copy(ROOT / "toxfile.py", tmp_path / "toxfile.py")
    marker = tmp_path / "ran.txt"
    (tmp_path / "tox.ini").write_text(TOX_INI.format(marker=marker))

    kept = _tox(tmp_path)
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
    assert marker.read_text() == "ran" and (tmp_path / ".tox" / "small" / "bin" / "python").exists()

    marker.unlink()
    discarded = _tox(tmp_path, "--discard")
    assert discarded.returncode == 0, discarded.stdout[-3000:] + discarded.stderr[-3000:]
    assert marker.read_text() == "ran", "the environment's commands must run before it is removed"
    assert not (tmp_path / ".tox" / "small").exists()
    assert "removing" in discarded.stdout + discarded.stderr


def test_discard_keeps_an_environment_that_failed(tmp_path: Path) -> None:
    shutil.copy(ROOT / "toxfile.py", tmp_path / "toxfile.py")
    (tmp_path / "tox.ini").write_text(TOX_INI.format(marker=tmp_path / "ran.txt"))
    failed = _tox(tmp_path, "--discard", env="failing")
    assert failed.returncode != 0, failed.stdout[-3000:]
    assert (tmp_path / ".tox" / "failing" / "log").is_dir()
    assert "removing" not in failed.stdout + failed.stderr


def test_the_flag_is_in_tox_help() -> None:
    done = subprocess.run([sys.executable, "-m", "tox", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "--discard" in done.stdout, done.stderr[-3000:]
