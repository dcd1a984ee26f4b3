"""Every script in benchmarks/ has a docstring, a working `--help`, and a line in the docs.

A `--help` that crashes (a moved import, a path that no longer exists, a bad default) is what a
reader of docs/benchmarks.md meets first, so each script's real `--help` runs here. Starting 35
interpreters that each import torch takes a minute and a half on a loaded 2-core machine, so
one driver process (this file, run as a script) imports the libraries the scripts share once and
forks a child per script, which runs it as `python benchmarks/<group>/<script>.py --help` would:
`__main__`, its own folder first on `sys.path`, its exit status and output captured. The shell
scripts run under bash.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
PY_SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if p.name != "__init__.py")
SH_SCRIPTS = sorted(BENCH.rglob("*.sh"))
PARALLEL = 4  # children at once: each mostly waits on its own imports


def _run_help(path: str, out_path: str) -> int:
    """In a forked child: run one script's `--help` as `__main__`, output to `out_path`."""
    import runpy
    import traceback

    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [path, "--help"]
    sys.path[0] = str(Path(path).parent)
    code = 1
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _driver(paths: list[str]) -> dict[str, dict[str, object]]:
    """Fork one child per script, `PARALLEL` at a time; {path: {code, output}}."""
    import httpx  # noqa: F401  -- what most scripts import, loaded once before the forks
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import fastserve  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="fastserve-bench-help-"))
    running: dict[int, str] = {}
    results: dict[str, dict[str, object]] = {}

    def reap() -> None:
        pid, status = os.wait()
        path = running.pop(pid)
        out = tmp / f"{pid}.out"
        results[path] = {"code": os.waitstatus_to_exitcode(status),
                         "output": out.read_text(errors="replace")}
        out.unlink()

    for path in paths:
        if len(running) >= PARALLEL:
            reap()
        pid = os.fork()
        if pid == 0:
            os._exit(_run_help(path, str(tmp / f"{os.getpid()}.out")))
        running[pid] = path
    while running:
        reap()
    tmp.rmdir()
    return results


@pytest.fixture(scope="module")
def py_help() -> dict[str, dict[str, object]]:
    proc = subprocess.run([sys.executable, __file__, *map(str, PY_SCRIPTS)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_there_are_scripts() -> None:
    # The grouping keeps every script one folder down: benchmarks/<group>/<script>.
    assert len(PY_SCRIPTS) >= 30 and SH_SCRIPTS
    loose = [p.name for p in BENCH.iterdir() if p.is_file() and p.name != "__init__.py"]
    assert not loose, f"scripts outside a group folder in benchmarks/: {loose}"


@pytest.mark.parametrize("path", PY_SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_python_script_help(path: Path, py_help: dict[str, dict[str, object]]) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc) > 40, f"{path.relative_to(REPO)}: no module docstring"
    result = py_help[str(path)]
    output = str(result["output"])
    assert result["code"] == 0, f"{path.relative_to(REPO)} --help exited {result['code']}:\n{output[-3000:]}"
    assert output.startswith("usage: ") and "--help" in output, output[:500]


@pytest.mark.parametrize("path", SH_SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_shell_script_help(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#!") and lines[1].startswith("# "), "no header comment"
    proc = subprocess.run(["bash", str(path), "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: bash benchmarks/{path.relative_to(BENCH)}" in proc.stdout or \
        f"usage: benchmarks/{path.relative_to(BENCH)}" in proc.stdout, proc.stdout


def test_every_script_is_in_the_docs() -> None:
    """docs/benchmarks.md names every script by its path, so the index cannot lose one."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in [*PY_SCRIPTS, *SH_SCRIPTS]
               if str(p.relative_to(REPO)) not in page]
    assert not missing, f"scripts docs/benchmarks.md does not name: {missing}"


if __name__ == "__main__":
    print(json.dumps(_driver(sys.argv[1:])))
