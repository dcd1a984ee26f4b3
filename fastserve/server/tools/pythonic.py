"""The pythonic format (vLLM's Llama 3.2 pythonic template, Llama 4, ToolACE): calls as a Python
list of function calls with keyword arguments,

    [get_weather(city="Paris", unit="c"), add(a=1, b=2)]

read with Python's own parser (`ast`): a list whose every element is a call of a plain name
with literal keyword arguments is calls (the arguments as JSON), anything else is content as
written. A list is read whole at its closing `]`.

No grammar holds Python calls here: under `auto` they are free (a `strict` function is not
enforced, as vLLM enforces none under auto), and a forced output (`required`, a named
function) is written and read in the Llama 3 JSON format, as vLLM forces calls in JSON.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from fastserve.server.tools.base import CallDelta, HeldSpace, Parsed, ToolFormat, is_text
from fastserve.server.tools.llama3_json import LLAMA3_JSON

# A call list's start, and what may still become one (held until it is known).
_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_MAYBE_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?\Z")


class PythonicParser:
    """Splits one sequence's output into content and pythonic calls, as the text arrives."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_list = False
        self._scanner = _PythonScanner()
        self._num_scanned = 0  # of `_pending`, in a list
        self._held = HeldSpace()
        self._space_before_call = ""
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while self._in_list and self._read_list(out) or not self._in_list and self._read_text(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The rest: an unclosed list is no call (its Python cannot be read)."""
        out = Parsed()
        rest = (self._space_before_call if self._in_list else "") + self._pending
        out.text(self._held.send(rest))
        self._pending, self._in_list = "", False
        space = self._held.take()
        if self.num_calls == 0:
            out.text(space)
        return out

    def _read_text(self, out: Parsed) -> bool:
        start = _START.search(self._pending)
        if start is None:
            keep = next((len(self._pending) - i for i in range(len(self._pending))
                         if self._pending[i] == "[" and _MAYBE_START.match(self._pending, i)), 0)
            out.text(self._held.send(self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        out.text(self._held.send(self._pending[:start.start()]))
        self._space_before_call = self._held.take()
        self._pending = self._pending[start.start():]
        self._in_list, self._scanner, self._num_scanned = True, _PythonScanner(), 0
        return True

    def _read_list(self, out: Parsed) -> bool:
        self._num_scanned += self._scanner.scan(self._pending[self._num_scanned:])
        if not self._scanner.is_closed:
            return False
        body, self._pending = self._pending[:self._num_scanned], self._pending[self._num_scanned:]
        calls = _parse_calls(body)
        if calls is None:
            out.text(self._held.send(self._space_before_call + body))
        for name, arguments in calls or []:
            out.call(CallDelta(self.num_calls, name, arguments))
            self.num_calls += 1
        self._in_list, self._space_before_call = False, ""
        return True


class _PythonScanner:
    """Follows a Python list's text to its closing `]`: strings (either quote, escapes) and
    nesting."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escaped = False
        self.is_closed = False

    def scan(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.is_closed = True
                    return i + 1
        return len(text)


def _parse_calls(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments' JSON) of each call of a Python list of calls, or None if it is not
    one."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError):
            return None
        if len(arguments) != len(node.keywords) or not is_text(text):
            return None
        calls.append((node.func.id, text))
    return calls


def _literal(node: ast.expr) -> Any:
    """A literal's value; JSON's true, false and null are read too (a model may write them)."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    value = ast.literal_eval(node)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, set | frozenset | bytes | complex):
        raise ValueError("not a JSON value")
    return value


PYTHONIC = ToolFormat(
    "pythonic", begin="", end="", trigger="", separator="", parser=PythonicParser,
    forced=LLAMA3_JSON)
