"""benchmarks/gpu/gpu_acceptance.py's deadline, checked on a CPU with real short processes: steps
run in priority order, each limit trimmed to what is left, a step that cannot finish skipped,
a step past its limit stopped with the processes it started, and the summary a user reads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance",
                                                  ROOT / "benchmarks" / "gpu" / "gpu_acceptance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


ga = _load()


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_steps_run_in_order_trimmed_and_skipped_past_the_deadline(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    steps = [
        ga.Step("quick", 30, 1, _py("print('quick ran')")),
        ga.Step("fails", 30, 1, _py("import sys; print('broken'); sys.exit(3)")),
        # Starts a process of its own and outlives what is left: stopped, child and all.
        ga.Step("slow", 30, 1, _py(
            "import subprocess, sys, time;"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('slow started', flush=True);"
            "time.sleep(60)")),
        ga.Step("late", 30, 1, _py("print('late ran')")),
    ]
    budget = 4.0
    t0 = time.monotonic()
    outcomes = ga.run_steps(steps, budget, tmp_path)
    elapsed = time.monotonic() - t0
    assert [o.name for o in outcomes] == ["quick", "fails", "slow", "late"]
    assert [o.status for o in outcomes] == ["ok", "failed", "timeout", "skipped"]
    assert outcomes[1].rc == 3
    # "slow" ran under what was left of the 4 s, not its own 30
    assert outcomes[2].limit_s < budget and outcomes[2].seconds == pytest.approx(
        outcomes[2].limit_s, abs=1.5)
    assert elapsed < budget + 6  # the deadline held (plus the stop's grace)
    # The step's own child went with it (its group was signalled; on a loaded machine the
    # signal may take a moment to land).
    child = int(pid_file.read_text())
    gone_by = time.monotonic() + 5
    while _is_running(child) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not _is_running(child)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["quick", "fails", "slow", "late"]
    assert "FAILED rc=3" in summary[1] and "TIMEOUT" in summary[2]
    assert "SKIPPED (budget" in summary[3]

    ga.finish(tmp_path, outcomes)
    text = (tmp_path / "summary.txt").read_text()
    assert "==> quick (ok)\nquick ran" in text and "==> fails (failed)\nbroken" in text
    assert "stopped at its limit" in text
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        assert sorted(tar.getnames()) == ["logs", "logs/fails.log", "logs/quick.log",
                                          "logs/slow.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.pid", "logs.tgz", "summary.txt"]


def test_a_step_needing_more_than_is_left_is_skipped_but_later_short_ones_run(
        tmp_path: Path) -> None:
    steps = [ga.Step("big", 30, 20, _py("print('big')")),
             ga.Step("small", 30, 1, _py("print('small')"))]
    outcomes = ga.run_steps(steps, 5.0, tmp_path)
    assert [o.status for o in outcomes] == ["skipped", "ok"]
    assert outcomes[1].limit_s <= 5.0


def test_selection_keeps_priority_order_and_names_unknown_steps() -> None:
    default = [s.name for s in ga.select(None)]
    assert default == ["kernels", "decode", "fp8", "thr32", "thr128-fp8", "tests", "served"]
    assert [s.name for s in ga.select("served,kernels,sweep")] == ["kernels", "served", "sweep"]
    with pytest.raises(SystemExit, match="unknown steps \\['decod'\\]"):
        ga.select("decod")


def test_dry_run_prints_the_plan(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_acceptance.py"), "--dry-run",
         "--steps", "decode,sweep", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("budget 450 s")
    assert lines[1].startswith("decode") and "gpu_decode.py" in lines[1]
    assert lines[2].startswith("sweep") and f"--out {tmp_path / 'o'}" in lines[2]
    assert not (tmp_path / "o").exists()
    # The default: every default step, each able to start under the 450 s budget (one device
    # call of at most 8 minutes with the machine's setup, leaving room for a rerun).
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_acceptance.py"),
                           "--dry-run"], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.startswith("budget 450 s")
    assert len(proc.stdout.splitlines()) == 1 + len(ga.select(None))
    assert all(s.min_s < 450 for s in ga.select(None))
