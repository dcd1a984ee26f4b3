"""`fastserve serve`'s fleet flags: the plain server never imports Ray, and a bad fleet option
is refused with a message naming it before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_plain_serve_does_not_import_ray() -> None:
    code = ("import sys; from fastserve.cli import build_parser; "
            "args = build_parser().parse_args(['serve', '--port', '0']); "
            "assert args.replicas is None; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bad_fleet_options_are_refused_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray.serve")  # without it, every fleet flag names the missing extra
    from fastserve.cli import main

    for flags, message in ((["--replicas", "0"], "replicas: must be at least 1"),
                           (["--replicas", "2", "--stream-batch-ms", "-5"],
                            "stream_batch_ms: must be within 0-1000 (ms), got -5.0"),
                           (["--replicas", "2", "/no/such/model"], "is not a model directory"),
                           (["--replicas", "2", "--allow-runtime-lora-updating"],
                            "allow_runtime_lora_updating: not with --replicas")):
        assert main(["serve", "--port", "0", *flags]) == 2
        assert message in capsys.readouterr().err
