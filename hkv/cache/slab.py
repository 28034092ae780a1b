"""One byte budget for pages and checkpoints: units of one page, grouped in blocks of one checkpoint.

    units   [ u0 u1 u2 | u3 u4 u5 | u6 u7 u8 | ... ]      k = units_per_block = ceil(state_bytes / page_bytes)
    blocks  [ block 0  | block 1  | block 2  | ... ]
    a block is: free | a page block (1..k of its units hold pages) | one checkpoint

A page entry is a unit id, a checkpoint entry a block id (its bytes are the
block's first `state_bytes`), so a pool of U units holds any mix of pages and
U / k checkpoints; a dense model has no checkpoints and k = 1. Pages fill
page blocks that have free units before a free block is opened, which keeps
free blocks for checkpoints; `CpuTier` moves pages out of a page block when a
checkpoint needs the block and the free units elsewhere can take them
(compaction), so free space scattered over page blocks is never lost.
Plain bookkeeping: the slab hands out ids, its owner decides what goes.
"""

from __future__ import annotations


class Slab:
    """Free units and blocks; every id is free, a used unit of a page block, or a checkpoint block."""

    def __init__(self, blocks: int, units_per_block: int):
        if blocks < 0 or units_per_block < 1:
            raise ValueError(f"a slab needs blocks >= 0 and units_per_block >= 1, got {blocks}, {units_per_block}")
        self.blocks: int = blocks
        self.units_per_block: int = units_per_block
        self._free_blocks: list[int] = list(range(blocks))[::-1]  # a stack: lowest id first
        self._open: dict[int, list[int]] = {}  # page block with free units -> those units (a stack), oldest first
        self._used: list[int] = [0] * blocks  # units holding pages, per block
        self._checkpoint: list[bool] = [False] * blocks
        self._open_units: int = 0  # free units inside open page blocks

    @property
    def units(self) -> int:
        return self.blocks * self.units_per_block

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_units(self) -> int:
        """Units no page or checkpoint holds: those of free blocks and of open page blocks."""
        return self._open_units + len(self._free_blocks) * self.units_per_block

    def block_of(self, unit: int) -> int:
        return unit // self.units_per_block

    def take_unit(self, avoid: int | None = None) -> int | None:
        """A free unit for a page: from the oldest open page block (not `avoid`), else a fresh block; None if none."""
        for block, free in self._open.items():
            if block != avoid:
                return self._take_from(block, free)
        if avoid is not None or not self._free_blocks:
            return None
        block = self._free_blocks.pop()
        k = self.units_per_block
        free = list(range(block * k + k - 1, block * k - 1, -1))
        self._open[block] = free
        self._open_units += k
        return self._take_from(block, free)

    def _take_from(self, block: int, free: list[int]) -> int:
        unit = free.pop()
        self._open_units -= 1
        self._used[block] += 1
        if not free:
            del self._open[block]
        return unit

    def give_unit(self, unit: int) -> None:
        """A page's unit is free again; a page block left empty becomes a free block."""
        block = self.block_of(unit)
        assert self._used[block] > 0 and not self._checkpoint[block], f"unit {unit} is not a used page unit"
        self._used[block] -= 1
        if self._used[block] == 0:
            self._open_units -= len(self._open.pop(block, ()))
            self._free_blocks.append(block)
            return
        self._open.setdefault(block, []).append(unit)
        self._open_units += 1

    def take_block(self) -> int | None:
        """A free block for a checkpoint, or None."""
        if not self._free_blocks:
            return None
        block = self._free_blocks.pop()
        self._checkpoint[block] = True
        return block

    def give_block(self, block: int) -> None:
        assert self._checkpoint[block], f"block {block} holds no checkpoint"
        self._checkpoint[block] = False
        self._free_blocks.append(block)

    def open_blocks(self) -> list[tuple[int, int]]:
        """(units used, block) of each page block with free units, fewest used first: compaction's candidates."""
        return sorted((self._used[block], block) for block in self._open)

    def room_outside(self, block: int) -> int:
        """Free units in open page blocks other than `block` (where its pages could move)."""
        return self._open_units - len(self._open.get(block, ()))

    def used_units(self, block: int) -> list[int]:
        """The units of page block `block` that hold pages."""
        k = self.units_per_block
        free = set(self._open.get(block, ()))
        return [u for u in range(block * k, block * k + k) if u not in free]

    def check(self, page_units: list[int], checkpoint_blocks: list[int]) -> None:
        """Prove every unit and block is in exactly one place, given the owner's page units and checkpoint blocks."""
        k = self.units_per_block
        assert len(set(page_units)) == len(page_units), "a unit holds two pages"
        assert sorted(checkpoint_blocks) == sorted(b for b in range(self.blocks) if self._checkpoint[b]), (
            f"checkpoint blocks {sorted(checkpoint_blocks)} != the slab's")
        free_units = [u for units in self._open.values() for u in units]
        assert len(free_units) == self._open_units, f"open units {self._open_units} != {len(free_units)}"
        whole = [u for b in self._free_blocks for u in range(b * k, b * k + k)]
        ckpt = [u for b in checkpoint_blocks for u in range(b * k, b * k + k)]
        every = sorted(page_units + free_units + whole + ckpt)
        assert every == list(range(self.units)), f"units unbalanced: {every}"
        for block in range(self.blocks):
            used = sum(1 for u in page_units if self.block_of(u) == block)
            assert used == self._used[block], f"block {block}: {used} page units, {self._used[block]} counted"
