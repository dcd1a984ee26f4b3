"""Comparing greedy generations across runs, batch shapes, kernels and machines.

In float32 two runs of the tiny model give the same greedy tokens bit for bit (the few ulps two
kernels differ by never flip its argmax), and the tests compare them so. In a half type
(FASTSERVE_TEST_DTYPE=bfloat16) another batch shape, chunking, recompute or CPU rounds
differently and may flip a near-tie; there each output must instead be a greedy path of the
float32 model up to a near-tie: every token within NEAR_TIE of that step's best logit, under
Hugging Face's float32 forward over the output itself (STYLE.md habit 16).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.conftest import IS_EXACT_DTYPE

# How far below the float32 argmax (in logits) a bfloat16 greedy token may be. Measured here
# (1,600 bfloat16 greedy tokens of 100 prompts, batch 16): 44 were not the float32 argmax, the
# farthest 0.22 below it. The tiny model's logits spread with std ~4, and the median gap between
# its best two tokens is 0.74: a wrong token (a lost or misplaced KV block) lands far lower.
NEAR_TIE = 0.5


class GreedyReference:
    """The float32 checkpoint through Hugging Face, loaded on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @functools.cached_property
    def _model(self) -> torch.nn.Module:
        transformers = pytest.importorskip("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        return model.eval()

    def shortfalls(self, prompt: Sequence[int], output: Sequence[int]) -> list[float]:
        """How far each output token's float32 logit is below the best one at its step."""
        seq = torch.tensor([list(prompt) + list(output)])
        with torch.inference_mode():
            # [len(output), vocab]: the logits each output token was chosen from
            logits = self._model(seq).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(list(output)).unsqueeze(1)).squeeze(1)
        return (logits.max(dim=-1).values - chosen).tolist()

    def assert_near_greedy(self, prompt: Sequence[int], output: Sequence[int], what: str) -> None:
        gaps = self.shortfalls(prompt, output)
        worst = max(range(len(gaps)), key=gaps.__getitem__, default=None)
        assert worst is None or gaps[worst] <= NEAR_TIE, (
            f"{what}: output token {worst} ({output[worst]}) is {gaps[worst]:.3f} below the "
            f"float32 argmax (a near-tie is <= {NEAR_TIE})")


def assert_same_greedy_tokens(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
                              prompts: Sequence[Sequence[int]], ref: GreedyReference) -> None:
    """The greedy outputs `got` are those of `want` (float32: token for token; a half type:
    as many tokens each, every one of both a greedy path of the float32 model up to near-ties)."""
    got, want = [list(g) for g in got], [list(w) for w in want]
    if IS_EXACT_DTYPE:
        assert got == want
        return
    assert [len(g) for g in got] == [len(w) for w in want]
    assert len(prompts) == len(got)
    for i, (g, w, p) in enumerate(zip(got, want, prompts, strict=True)):
        ref.assert_near_greedy(p, g, f"output {i}")
        if w != g:
            ref.assert_near_greedy(p, w, f"expected output {i}")
