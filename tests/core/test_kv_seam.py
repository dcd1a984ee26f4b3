"""The KV seam stays narrow: code outside `fastserve/core/kv/` uses only these `KVSpace` calls
(every attribute read on an object named `kv` that names a `KVSpace` member counts).

    python tests/core/test_kv_seam.py   # prints each member used and where
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from fastserve.core.kv import KVSpace

PACKAGE = Path(__file__).parents[2] / "fastserve"
SEAM = {"begin", "lookup", "reserve", "free", "commit", "end_iteration", "stats", "prefix_hold"}


def kv_members_used_outside() -> dict[str, set[str]]:
    """{KVSpace member: files outside fastserve/core/kv that use it}."""
    members = {name for name in dir(KVSpace) if not name.startswith("__")}
    uses: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel.startswith("fastserve/core/kv/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in members:
                continue
            owner = node.value
            name = (owner.id if isinstance(owner, ast.Name)
                    else owner.attr if isinstance(owner, ast.Attribute) else None)
            if name == "kv":
                uses[node.attr].add(rel)
    return uses


def test_only_the_seam_is_used_outside_the_kv_package() -> None:
    used = kv_members_used_outside()
    assert set(used) <= SEAM, f"KV members used outside core/kv beyond the seam: {set(used) - SEAM}"
    assert "reserve" in used and "end_iteration" in used  # (the scan finds the scheduler's calls)


if __name__ == "__main__":
    found = kv_members_used_outside()
    files = sorted({f for fs in found.values() for f in fs})
    print(f"{len(found)} distinct KV members used outside fastserve/core/kv, from {len(files)} files")
    for member in sorted(found):
        print(f"  {member}: {', '.join(sorted(found[member]))}")
