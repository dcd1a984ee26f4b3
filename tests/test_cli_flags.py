"""The command line as a vLLM user types it: every flag explained with its default, vLLM's
names accepted, and models fastserve cannot serve refused with what it can."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from fastserve.args import engine_config_from_args
from fastserve.cli import build_parser, main, version
from fastserve.model.tokenizer import Tokenizer

# Flags whose help need not state a default: they take no value, or one is required.
_NO_DEFAULT = {"-h", "--help", "--version"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"fastserve": parser, **action.choices}


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_says_what_it_does_and_its_default(command: str) -> None:
    bare = []
    for action in _subparsers()[command]._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or set(action.option_strings) & _NO_DEFAULT:
            continue
        text = " ".join((action.help or "").split())
        name = flags[0].removeprefix("--").replace("-", " ")
        words = re.sub(r"\(default: [^)]*\)", "", text).strip(" .").lower()
        if words in ("", name, name.replace(" ", "_")) or len(words.split()) < 3:
            bare.append(f"{flags[0]}: {text!r}")
        elif not action.required and "default" not in text:
            bare.append(f"{flags[0]} names no default: {text!r}")
    assert not bare, "\n".join(bare)


def test_serve_dtype_help_shows_serves_default_auto() -> None:
    serve = _subparsers()["serve"]
    dtype = next(a for a in serve._actions if "--dtype" in a.option_strings)
    assert "(default: auto)" in dtype.help and "float32)" not in dtype.help
    assert serve.parse_args([]).dtype == "auto"
    generate = _subparsers()["generate"]
    assert generate.parse_args(["--prompt", "x"]).dtype is None  # the config's float32


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float16", "float16"),
                                              ("float", "float32"), ("bfloat16", "bfloat16"),
                                              ("auto", "auto")])
def test_dtype_takes_vllms_names(given: str, dtype: str) -> None:
    args = build_parser().parse_args(["serve", "--dtype", given])
    assert engine_config_from_args(args).model.dtype == dtype


def test_bad_dtype_names_the_accepted_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "fp64"])
    assert "'fp64': one of auto, float32, bfloat16, float16, half, float" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastserve {version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())


def test_vllm_serve_flags_are_accepted(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                      "--chat-template", str(template), "--dtype", "half"])
    assert args.enable_auto_tool_choice
    assert engine_config_from_args(args).model.chat_template == str(template)


def test_chat_template_from_a_file_or_inline(tiny_model_path: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    template = tmp_path / "template.jinja"
    template.write_text("FILE {{ messages[0]['content'] }}")
    from_file = Tokenizer(tiny_model_path, str(template))
    assert from_file.apply_chat_template(messages).startswith("FILE Hi")
    inline = Tokenizer(tiny_model_path, "INLINE {% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert inline.apply_chat_template(messages).startswith("INLINE Hi")


@pytest.mark.parametrize(("value", "message"), [
    ("no/such/template.jinja", "neither a file nor a Jinja template"),
    ("{% for m in messages %}", "does not compile"),
])
def test_bad_chat_template_is_refused_naming_the_flag(tiny_model_path: Path, value: str,
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=f"--chat-template: .*{message}"):
        Tokenizer(tiny_model_path, value)


def test_a_model_without_a_chat_template_gets_a_warning(tiny_model_path: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        Tokenizer(model)
    assert "has no chat template of its own" in caplog.text and "--chat-template" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Tokenizer(tiny_model_path)  # its own: no warning
    assert "chat template" not in caplog.text


@pytest.mark.parametrize(("model", "says"), [
    ("meta-llama/Llama-2-7b-hf", "huggingface-cli download meta-llama/Llama-2-7b-hf --local-dir"),
    ("llama-2-7b.Q4_K_M.gguf", "GGUF files are not supported"),
])
def test_a_hub_id_or_gguf_is_refused_with_what_is_supported(
        model: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", model, "--prompt", "x", "--no-startup-profile"]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "local Hugging Face-format directory" in err and "fastserve make-model" in err
