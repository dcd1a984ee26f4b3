"""KV block manager: which device blocks each request holds.

Pure bookkeeping over block ids; the executor owns the tensors these ids index.
"""

from __future__ import annotations

from fastserve.core.block_pool import BlockPool


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Per-request block tables over one device block pool."""

    def __init__(self, num_device_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self._tables: dict[str, list[int]] = {}
        self.peak_used_blocks = 0

    @property
    def num_total_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks still missing for the request to hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; None (nothing taken) if short."""
        need = self.num_new_blocks(request_id, num_tokens)
        table = self._tables.setdefault(request_id, [])
        if need == 0:
            return []
        new = self.device.allocate(need, after=table[-1] if table else None)
        if new is None:
            if not table:
                del self._tables[request_id]
            return None
        table += new
        self.peak_used_blocks = max(self.peak_used_blocks, self.device.num_used)
        return new

    def free(self, request_id: str) -> int:
        """Release every block the request holds; returns how many."""
        table = self._tables.pop(request_id, [])
        self.device.free(table)
        return len(table)
