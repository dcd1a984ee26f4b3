"""`srpt-oracle`: shortest remaining processing time, told each job's true output length.

Not deployable (nobody knows output lengths in advance): it is the benchmark's lower bound on
mean JCT, and the only policy allowed to read `Request.oracle_output_len`.
"""

from __future__ import annotations

from fastserve.core.policies.keyed_order import KeyedOrderPolicy
from fastserve.request import Request


class SRPTOraclePolicy(KeyedOrderPolicy):
    """Least predicted remaining time first, re-decided every iteration (preemptive).

    Remaining time = remaining tokens x one decode step at the current context, plus a prefill
    of every token when the job holds no KV (new, or dropped for recompute); ties go to the
    earlier arrival.
    """

    def check(self, req: Request) -> None:
        n = req.oracle_output_len
        if n is None or isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(
                f"policy 'srpt-oracle' needs Request.oracle_output_len (the true output length, "
                f"a positive int) for request {req.request_id!r}, got {n!r}"
            )

    def remaining_s(self, req: Request) -> float:
        return self._priority(req)

    def _priority(self, req: Request) -> float:
        """The job's predicted remaining time."""
        assert req.oracle_output_len is not None  # checked in `check`
        total = min(req.oracle_output_len, req.params.max_tokens)
        left = max(1, min(total - req.num_output_tokens, req.max_model_len - req.num_tokens))
        step_s = self.cost.decode_s(req.num_tokens)
        if req.num_computed_tokens == 0:  # its next iteration prefills and yields a token
            return self.cost.prefill_s(req.num_tokens) + (left - 1) * step_s
        return left * step_s
