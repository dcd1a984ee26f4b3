"""The docs and the CLI cannot drift apart: docs/cli.md names every flag of every `fastserve`
command, and no page (docs/**/*.md, README.md) names a flag a fastserve command lacks.

docs/cli.md is made from the real parsers by this file (`python tests/test_docs_cli.py --write`),
with the hand-written descriptions in `DESCRIBE` where a flag's `--help` is only its name.

Where a page names a flag of a fastserve command (the only flags checked; pip's, mkdocs' or a
benchmark script's are not fastserve's):
- on a line (a code block's lines joined at a trailing backslash, or a line of prose) after
  `fastserve <command>` (also `.venv/bin/fastserve` and `python -m fastserve.cli`), up to a shell
  separator (`|`, `&&`, `;`) in code; each flag belongs to the nearest command before it;
- in the first cell of a table row in a section whose heading names `fastserve <command>`
  (docs/cli.md's tables).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI_MD = REPO / "docs" / "cli.md"
COMMANDS = ("serve", "generate", "bench", "profile", "make-model", "make-lora")
WRITE_HINT = ("regenerate it with `python tests/test_docs_cli.py --write` (add a line to its "
              "DESCRIBE where the flag's --help is only its name), or add a row to the table")

# Descriptions for flags whose `--help` only spells their name (the engine's config fields).
DESCRIBE = {
    "--prompt": "the prompt text",
    "--max-tokens": "most tokens to generate",
    "--temperature": "sampling temperature; 0 = greedy",
    "--top-p": "nucleus sampling: keep the smallest set of tokens with this much probability",
    "--top-k": "sample among the k most likely tokens; 0 = all",
    "--sampling-seed": "seed of this request's sampling (default: the engine's --seed)",
    "--preset": "the architecture and size of the checkpoint to write",
    "--out": "output path",
    "--seed": "random seed",
    "--rank": "the adapter's LoRA rank",
    "--alpha": "the adapter's LoRA alpha (scale = alpha / rank)",
    "--log-level": "the server's log level",
    "--device": "torch device: cpu, cuda, cuda:N",
    "--warmup": "run warm-up passes at start-up",
    "--startup-profile": "without --profile, measure the cost model at start-up (cached per "
                         "model, dtype and device); off = a generic cost model",
    "--num-threads": "torch intra-op threads on CPU; 0 = torch's default (one per core)",
    "--record-iterations": "keep the batch shape and wall time of the last N iterations (read "
                           "by `fastserve profile --through-engine`); 0 = off",
    "--max-model-len": "most tokens of one request, prompt and output; default: the "
                       "checkpoint's max_position_embeddings",
    "--attention-backend": "attention kernels: auto (Triton on CUDA, the C++ kernels on CPU), or "
                           "a backend by name",
    "--enforce-eager": "no CUDA graphs: every decode iteration runs eagerly",
    "--cuda-graph-max-batch-size": "decode batches up to this size replay a captured CUDA graph "
                                   "(padded to 1, 2, 4, 8, then multiples of 16)",
    "--block-size": "tokens per KV-cache block",
    "--num-device-blocks": "device KV blocks (overrides --kv-cache-gib)",
    "--swap-space-gib": "host KV pool in GiB (pinned on CUDA); unused by defer and recompute",
    "--num-host-blocks": "host KV blocks (overrides --swap-space-gib)",
    "--kv-policy": "what happens when the device KV pool runs short: proactive (offload ahead "
                   "of need), reactive (swap on demand), defer, recompute",
    "--burst-queues": "the top MLFQ queues whose non-resident jobs `proactive` keeps room for",
    "--enable-prefix-caching": "share the KV of full blocks an earlier request computed",
    "--max-num-batched-tokens": "an iteration's token budget: a decode takes one, a prefill the "
                                "rest (longer prompts are prefilled in chunks)",
    "--base-quantum-ms": "MLFQ: the top queue's quantum; 0 = --quantum-decode-steps decode "
                         "steps' charge",
    "--quantum-decode-steps": "MLFQ: the top queue's quantum in decode steps (robust 4, paper 1)",
    "--quantum-ratio": "MLFQ: each queue's quantum over the one above it",
    "--mlfq-charge": "MLFQ: what a batched job is charged per iteration: own (its share, "
                     "robust) or iteration (the whole iteration, paper)",
    "--starve-limit-s": "MLFQ: promote a job that waited this long to the top queue (robust 0 = "
                        "off, paper 10)",
    "--mlfq-max-overtakes": "robust MLFQ: how many later, started jobs may run ahead of a job "
                            "waiting in the lowest queue (default 4 x --max-batch-size; 0 = "
                            "arrival order there)",
    "--mlfq-variant": "robust (default) or paper: the skip-join MLFQ settings as a set",
    "--tensor-parallel-size": "processes each layer's weights are split over",
    "--pipeline-parallel-size": "pipeline stages the layers are split over",
    "--worker-timeout-s": "how long a parallel worker may take to answer before it is "
                          "declared lost",
}


def fastserve_parsers() -> dict[str, argparse.ArgumentParser]:
    from fastserve.cli import build_parser

    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


# -- the page ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    if isinstance(action.default, (tuple, list)) and not action.default:
        return ""
    return _code(str(action.default))


def _code(value: str) -> str:
    """A literal value as code; a phrase ("profile at start-up, cached") as text."""
    return value if " " in value else f"`{value}`"


def _describe(action: argparse.Action) -> tuple[str, str]:
    """(description, default) of one flag; an engine flag's default is its config field's."""
    help_ = action.help or ""
    default = "required" if action.required else _default(action)
    # The engine's flags end in "(default: X)", X the config field's default (the parser's is
    # None); other flags may say theirs in words the same way.
    while m := re.search(r"\s*\(default: ((?:[^()]|\(\))*)\)$", help_):
        help_ = help_[:m.start()]
        if default in ("", "`None`") or m.group(1) not in ("None",):
            default = {"True": "on", "False": "off", "None": "", "()": ""}.get(m.group(1), _code(m.group(1)))
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if flag in DESCRIBE and (not help_ or help_.replace(" ", "-") == flag.lstrip("-")):
        help_ = DESCRIBE[flag]
    if action.choices and "`" not in help_ and not isinstance(action, argparse._SubParsersAction):
        help_ += f" (one of: {', '.join(map(str, action.choices))})"
    return help_, default


ENGINE_COMMANDS = ("serve", "generate", "bench", "profile")


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| Flag | Default | Description |", "| --- | --- | --- |"]
    for a in actions:
        names = ", ".join(f"`{s}`" for s in a.option_strings)
        if a.nargs != 0 and not isinstance(a, argparse.BooleanOptionalAction):
            names += f" *{a.metavar or a.dest.upper()}*"
        help_, default = _describe(a)
        rows.append(f"| {names} | {default} | {_cell(help_)} |")
    return rows + [""]


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if actions:
            title = "options" if group.title in ("options", "optional arguments") else group.title
            out.append((title or "options", actions))
    return out


def _shared(parsers: dict[str, argparse.ArgumentParser]) -> dict[str, list[argparse.Action]]:
    """The engine's option groups, flag for flag the same in every engine command."""
    per_cmd = [{(t, a.option_strings[0]) for t, acts in _groups(parsers[c]) for a in acts
                if t != "options"} for c in ENGINE_COMMANDS]
    common = set.intersection(*per_cmd)
    shared: dict[str, list[argparse.Action]] = {}
    for title, actions in _groups(parsers[ENGINE_COMMANDS[0]]):
        kept = [a for a in actions if (title, a.option_strings[0]) in common]
        if kept:
            shared[title] = kept
    return shared


def render() -> str:
    parsers = fastserve_parsers()
    shared = _shared(parsers)
    shared_flags = {(t, a.option_strings[0]) for t, acts in shared.items() for a in acts}
    engine = ", ".join(f"`fastserve {c}`" for c in ENGINE_COMMANDS)
    out = [
        "# Command-line reference",
        "",
        "Every flag of every `fastserve` command, made from the commands' own parsers by",
        "`python tests/test_docs_cli.py --write`; `tests/test_docs_cli.py` fails when a flag is",
        "missing here or when a page names one that does not exist. `fastserve <command> --help`",
        "prints the same. The [engine flags](#engine-flags) (model, cache, scheduler, parallel,",
        "LoRA, speculative) are shared by `serve`, `generate`, `bench` and `profile`; each maps",
        "onto one field of the frozen config dataclasses in `fastserve/config.py`. The scheduling",
        "flags are explained with measurements in [Scheduling](scheduling.md), the KV-cache ones",
        "in [KV cache](kv-cache.md).",
        "",
    ]
    for name in COMMANDS:
        parser = parsers[name]
        out += [f"## `fastserve {name}`", "",
                _cell(parser.description or _subparser_help(name)), ""]
        for a in parser._actions:
            if not a.option_strings:
                out += [f"Positional `{a.metavar or a.dest}`: {_cell(a.help or '')}", ""]
        for title, actions in _groups(parser):
            actions = [a for a in actions if (title, a.option_strings[0]) not in shared_flags]
            if actions:
                out += [f"### {name}: {title}", "", *_table(actions)]
        if name in ENGINE_COMMANDS:
            out += ["And the [engine flags](#engine-flags).", ""]
    out += ['<a id="engine-flags"></a>', "", f"## Engine flags: {engine}", "",
            "The same flags, defaults and meaning in each of these commands.", ""]
    for title, actions in shared.items():
        out += [f"### {title}", "", *_table(actions)]
    return "\n".join(out).rstrip() + "\n"


def _subparser_help(name: str) -> str:
    from fastserve.cli import build_parser

    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return next((c.help or "" for c in sub._choices_actions if c.dest == name), "")


# -- reading the pages ------------------------------------------------------------------------

CMD = re.compile(r"(?:^|[\s`/(])fastserve(?:\.cli)?\s+(" + "|".join(COMMANDS) + r")\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
HEADING = re.compile(r"^(#{1,6})\s+(.*)")
SEPARATOR = re.compile(r"\s(?:\||&&|;|\|\|)\s")


@dataclass(frozen=True)
class Mention:
    """A flag a page names for a fastserve command."""

    page: str
    line: int
    command: str
    flag: str


def _line_mentions(text: str) -> list[tuple[str, str]]:
    """(command, flag) pairs on one logical line: each flag after its nearest command."""
    found: list[tuple[str, str]] = []
    for segment in SEPARATOR.split(text):
        cmds = [(m.end(), m.group(1)) for m in CMD.finditer(segment)]
        for f in FLAG.finditer(segment):
            before = [c for end, c in cmds if end <= f.start()]
            if before:
                found.append((before[-1], f.group(0)))
    return found


def _section_flags(text: str) -> list[str]:
    """The flags a table row under a command's heading names for that command: those of its
    first cell (the flag column; a description may name other commands' flags). Prose under
    such a heading is read line by line only: it may well speak of another command."""
    if not text.lstrip().startswith("|"):
        return []
    first = re.split(r"(?<!\\)\|", text.strip())[1]
    return [f.group(0) for f in FLAG.finditer(first)]


def mentions(path: Path) -> list[Mention]:
    rel = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    out: list[Mention] = []
    in_code = False
    heading_cmds: list[tuple[int, list[str]]] = []  # (level, commands) of open headings
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        if text.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
            i += 1
            continue
        if in_code:  # a shell line continued with a backslash is one command
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
        elif m := HEADING.match(text):
            level = len(m.group(1))
            heading_cmds = [(lv, c) for lv, c in heading_cmds if lv < level]
            heading_cmds.append((level, [c.group(1) for c in CMD.finditer(" " + m.group(2))]))
        pairs = _line_mentions(text)
        section = next((c for _, c in reversed(heading_cmds) if c), [])
        if section and not in_code:
            pairs += [(c, f) for f in _section_flags(text) for c in section]
        out += [Mention(rel, start + 1, c, f) for c, f in pairs]
        i += 1
    return out


def pages() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


# -- the tests --------------------------------------------------------------------------------


def test_every_flag_is_documented() -> None:
    parsers = fastserve_parsers()
    documented: dict[str, set[str]] = {c: set() for c in COMMANDS}
    for m in mentions(CLI_MD):
        documented[m.command].add(m.flag)
    missing = [f"fastserve {c} {flag}: not in docs/cli.md; add a row for `{flag}` under the "
               f'heading "## `fastserve {c}`" (an engine flag: under "## Engine flags")'
               for c in COMMANDS for flag in sorted(flags_of(parsers[c]))
               if flag not in documented[c] and flag != "--help"]
    assert not missing, "\n".join(["flags the CLI has and docs/cli.md does not name:", *missing,
                                   "Or " + WRITE_HINT + "."])


def test_every_flag_the_docs_name_exists() -> None:
    parsers = fastserve_parsers()
    flags = {c: flags_of(parsers[c]) | {"--help"} for c in COMMANDS}
    wrong = [f"{m.page}:{m.line}: fastserve {m.command} has no {m.flag}"
             for p in pages() if p.exists() for m in mentions(p) if m.flag not in flags[m.command]]
    assert not wrong, "pages name flags that do not exist:\n" + "\n".join(wrong)


def test_the_checker_reads_commands_and_sections() -> None:
    """The page reader itself: what counts as a fastserve command's flag and what does not."""
    assert _line_mentions("fastserve serve --scheduler fcfs --port 8000 | jq --raw-output") == \
        [("serve", "--scheduler"), ("serve", "--port")]
    assert _line_mentions("pip install --upgrade fastserve") == []
    assert _line_mentions("`fastserve bench --plot p.png` then `fastserve serve --policy x`") == \
        [("bench", "--plot"), ("serve", "--policy")]
    assert _line_mentions("python -m fastserve.cli generate --prompt hi") == \
        [("generate", "--prompt")]
    assert _line_mentions("mkdocs build --strict") == []


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        CLI_MD.parent.mkdir(exist_ok=True)
        CLI_MD.write_text(render())
        print(f"wrote {CLI_MD.relative_to(REPO)}")
    else:
        sys.exit("usage: python tests/test_docs_cli.py --write   (regenerates docs/cli.md)")
