"""Building the CPU kernels survives a build that was killed: the next start gets the kernels
instead of waiting for ever on the lock file torch's build leaves behind (a first `make serve`
stopped with Ctrl-C while it compiles did that to every later start)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastserve.executor import cpu_kernels

LOAD = ("from fastserve.executor.cpu_kernels import decode_attention_kernel as k; "
        "m = k(); print(m.__file__ if m is not None else 'none')")


def test_a_killed_build_does_not_stop_the_next_start(tmp_path: Path) -> None:
    kernel = cpu_kernels.decode_attention_kernel()
    if kernel is None or kernel.__file__ is None:
        pytest.skip("no CPU kernels here (switched off, or no compiler)")
    built = Path(kernel.__file__).parent
    # A cache whose build was killed at its link: the objects are done, the library is cut
    # short, and torch's lock file is still there.
    killed = tmp_path / "torch_extensions" / built.name
    shutil.copytree(built, killed)
    library = killed / Path(kernel.__file__).name
    library.write_bytes(library.read_bytes()[:4096])
    (killed / "lock").touch()
    env = {**os.environ, "FASTSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True,
                         timeout=200)  # a relink takes seconds; a stale lock waited for ever
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(library), out.stderr  # loaded, from the rebuilt library
    assert not (killed / "lock").exists()
    # The next start imports the finished build as it is (no relink: the library is untouched).
    stamp = library.stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True,
                           timeout=200)
    assert again.stdout.strip() == str(library), again.stderr
    assert library.stat().st_mtime_ns == stamp
