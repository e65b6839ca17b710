"""KV block manager: hands out the paged pool's blocks to requests (docs/engine.md,
"Paged KV and attention").

Block 0 is scratch (padding tokens write there) and is never handed out. A request owns a list
of blocks, its block table, which grows as its sequence does; rollback of rejected drafts
never frees a block (the next step overwrites the stale entries). A request gives all its
blocks back when it finishes or is preempted.
"""
from __future__ import annotations

import collections

SCRATCH_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def seat_blocks(max_model_len: int, k_max: int, block_size: int) -> int:
    """Blocks one request may hold: max_model_len plus the K positions a verify step writes,
    with the draft slack rounded up to whole blocks and at least one. So every K up to
    block_size gives the same block-table width and pool, and engines that differ only in K
    trace identical prefill graphs (Inductor's FX cache serves the second one)."""
    return blocks_for(max_model_len, block_size) + max(1, blocks_for(k_max, block_size))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2 and block_size >= 1, (num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: collections.deque[int] = collections.deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def missing(self, blocks: list[int], num_tokens: int) -> int:
        """Blocks a table of `blocks` still needs to hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(blocks))

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` in place to hold num_tokens; False (nothing taken) if short."""
        n = self.missing(blocks, num_tokens)
        if n > len(self.free):
            return False
        blocks.extend(self.free.popleft() for _ in range(n))
        return True

    def release(self, blocks: list[int]) -> None:
        assert SCRATCH_BLOCK not in blocks, blocks
        self.free.extend(blocks)
        blocks.clear()
