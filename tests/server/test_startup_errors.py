"""Start-up failures of a real `fastserve serve` process: each ends in seconds, before the
model is allocated, with at most two lines of error naming the file, field or flag to fix and
no traceback (unless `--log-level debug`).

Each broken checkpoint links the tiny checkpoint's files but the one it breaks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastserve.server.cli import _bind
from tests.server.helpers import REPO, ServerProcess

EXIT_TIMEOUT_S = 60  # a failure before the model loads takes a few seconds (importing torch)


@dataclass
class Failure:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        """What stderr says beyond the start-up's INFO progress lines (each step logs what it
        does and how long it took)."""
        return [line for line in self.stderr.splitlines()
                if line.strip() and not _INFO_LINE.match(line)]


_INFO_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ INFO ")


def serve(model: Path | None, *args: str, env: dict[str, str] | None = None) -> Failure:
    """Run `fastserve serve` to its end (it must fail fast); its exit status and output."""
    cmd = [sys.executable, "-m", "fastserve.cli", "serve", *([str(model)] if model else []),
           "--port", "0", "--dtype", "float32", "--no-warmup", "--no-startup-profile",
           "--no-access-log", *args]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=EXIT_TIMEOUT_S)
    return Failure(proc.returncode, proc.stdout, proc.stderr)


def assert_short_error(failure: Failure, *names: str) -> None:
    """Exit status 2, one or two lines of error naming each of `names`, no traceback, and
    the model never loaded."""
    assert failure.returncode == 2, failure
    assert "Traceback" not in failure.stderr, failure.stderr
    assert 1 <= len(failure.error_lines) <= 2, failure.stderr
    assert failure.error_lines[-1].startswith("fastserve: error: "), failure.stderr
    for name in names:
        assert name in failure.stderr, (name, failure.stderr)
    assert "serving" not in failure.stdout


def broken_copy(tiny: Path, into: Path, name: str, breaks: Callable[[Path], None]) -> Path:
    """`tiny`'s files linked into `into/name`, then `breaks` applied to that directory."""
    out = into / name
    out.mkdir()
    for f in tiny.iterdir():
        (out / f.name).symlink_to(f)
    breaks(out)
    return out


def replace(name: str, content: bytes) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        (root / name).unlink()
        (root / name).write_bytes(content)
    return write


def config_with(**changes: object) -> Callable[[Path], None]:
    def write(root: Path) -> None:
        config = json.loads((root / "config.json").read_text())
        config.update(changes)
        (root / "config.json").unlink()
        # NOTE: json.dumps writes 1e9 as 1000000000.0: write the JSON text as a user would.
        text = json.dumps(config)
        for key, value in changes.items():
            if isinstance(value, float):
                text = text.replace(f'"{key}": {value!r}', f'"{key}": {value:g}')
        (root / "config.json").write_text(text)
    return write


@pytest.fixture(scope="module")
def broken_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("broken")


def test_unwritable_cache_names_the_variable(tmp_path: Path, tiny_model_path: Path) -> None:
    (tmp_path / "a-file").write_text("")  # a file where the cache's parent should be
    cache = tmp_path / "a-file" / "cache"
    failure = serve(tiny_model_path, env={"FASTSERVE_CACHE": str(cache)})
    assert_short_error(failure, f"FASTSERVE_CACHE={cache}", "not writable")


def test_garbage_tokenizer_names_the_file(broken_root: Path, tiny_model_path: Path) -> None:
    model = broken_copy(tiny_model_path, broken_root, "tokenizer",
                        replace("tokenizer.json", b"<html>not a tokenizer</html>"))
    assert_short_error(serve(model), str(model / "tokenizer.json"))


def test_truncated_safetensors_names_the_file(broken_root: Path, tiny_model_path: Path) -> None:
    weights = (tiny_model_path / "model.safetensors").read_bytes()
    model = broken_copy(tiny_model_path, broken_root, "truncated",
                        replace("model.safetensors", weights[: len(weights) // 2]))
    assert_short_error(serve(model), str(model / "model.safetensors"), "safetensors")


def test_corrupt_safetensors_names_the_file(broken_root: Path, tiny_model_path: Path) -> None:
    model = broken_copy(tiny_model_path, broken_root, "corrupt",
                        replace("model.safetensors", os.urandom(4096)))
    assert_short_error(serve(model), str(model / "model.safetensors"), "safetensors")


@pytest.mark.parametrize(("name", "changes", "names"), [
    ("layers", {"num_hidden_layers": 1e9}, ["config.json", "num_hidden_layers", "1024"]),
    ("hidden", {"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 200},
     ["config.json", "GiB"]),
    ("dtype", {"torch_dtype": "int3"}, ["config.json", "torch_dtype", "'int3'"]),
    ("eos", {"eos_token_id": 99999}, ["config.json", "eos_token_id", "99999"]),
])
def test_absurd_config_is_refused_before_loading(broken_root: Path, tiny_model_path: Path,
                                                 name: str, changes: dict[str, object],
                                                 names: list[str]) -> None:
    model = broken_copy(tiny_model_path, broken_root, name, config_with(**changes))
    assert_short_error(serve(model), *names)


@pytest.mark.parametrize(("changes", "message"), [
    ({"vocab_size": 10**9}, "vocab_size is 1000000000, over the limit"),
    ({"num_attention_heads": 6}, "hidden_size (256) must be a multiple of num_attention_heads (6)"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads (3)"),
    ({"num_hidden_layers": 4.5}, "num_hidden_layers must be an integer, got 4.5"),
    ({"bos_token_id": -1}, "bos_token_id is -1, outside the vocabulary"),
])
def test_config_limits_name_the_field(broken_root: Path, tiny_model_path: Path,
                                      changes: dict[str, object], message: str) -> None:
    """The same checks in process (the server runs them as above)."""
    from fastserve.model.loader import ModelLoadError, read_arch_config

    config = json.loads((tiny_model_path / "config.json").read_text())
    config.pop("head_dim")
    (broken_root / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        read_arch_config(broken_root)


def test_stop_token_outside_vocabulary_in_generation_config(broken_root: Path,
                                                            tiny_model_path: Path) -> None:
    model = broken_copy(tiny_model_path, broken_root, "generation",
                        replace("generation_config.json", b'{"eos_token_id": 5000}'))
    assert_short_error(serve(model), "generation_config.json", "eos_token_id 5000")


def test_taken_port_is_refused_before_the_model_loads(server: ServerProcess,
                                                      tiny_model_path: Path) -> None:
    """A second server on a running server's port: refused at once, naming port and flag."""
    port = server.url.rsplit(":", 1)[1]
    failure = serve(tiny_model_path, "--port", port)
    assert_short_error(failure, f"127.0.0.1:{port}", "--port", "in use")
    assert "loading" not in failure.stdout


def test_two_servers_started_at_once_cannot_share_a_port() -> None:
    """Both bind before either has loaded its model: the second is refused at its bind, not
    (as with a bound socket that listens only later) after loading the model."""
    first = _bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port} .*--port.*in use"):
            _bind("127.0.0.1", port)
    finally:
        first.close()


def test_debug_log_level_shows_the_traceback(broken_root: Path, tiny_model_path: Path) -> None:
    model = broken_copy(tiny_model_path, broken_root, "debug",
                        replace("tokenizer.json", b"garbage"))
    failure = serve(model, "--log-level", "debug")
    assert failure.returncode == 2
    assert "Traceback" in failure.stderr
    assert failure.error_lines[-1].startswith(f"fastserve: error: {model / 'tokenizer.json'}")


@pytest.mark.parametrize("preset", ["llama-3-8b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_production_configs_pass_the_limits(preset: str) -> None:
    """The limits refuse no real shape: the production presets' configs parse, and their
    weights' size is what the model card says."""
    from fastserve.model.arch import ArchConfig
    from fastserve.model.make_model import PRESETS, hf_config

    p = PRESETS[preset]
    arch = ArchConfig.from_hf_config(hf_config(p, p.model_vocab_size))
    billions = {"llama-3-8b": 8.0, "qwen3-8b": 8.2, "mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5}
    assert arch.num_params / 1e9 == pytest.approx(billions[preset], rel=0.03)
