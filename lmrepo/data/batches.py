"""Fixed-length blocks from a token file, and the deterministic order in which ranks read them.

The blocks form one endless stream: a seeded permutation of all blocks per epoch, epoch after
epoch. An optimizer step takes the next `global_batch` blocks of the stream, split into micro
batches and data-parallel ranks. The position in the stream (samples consumed) is all the
state there is: a resumed run reads exactly the blocks the uninterrupted one would have, with
any micro-batch / grad-accum / rank layout, and every layout of the same global batch gives
each optimizer step the same set of samples.
"""
from dataclasses import dataclass

import numpy as np
import torch


class TokenBlocks:
    """Non-overlapping `block_size`-token windows of a memory-mapped token stream."""

    def __init__(self, tokens: np.ndarray, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return len(self.tokens) // self.block_size

    def get(self, indices) -> torch.Tensor:
        rows = [self.tokens[i * self.block_size:(i + 1) * self.block_size] for i in indices]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


@dataclass(frozen=True)
class SampleOrder:
    n_blocks: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def stream(self, start: int, count: int) -> np.ndarray:
        """Block indices at stream positions [start, start + count), across epoch boundaries."""
        parts, position = [], start
        while position < start + count:
            epoch, within = divmod(position, self.n_blocks)
            take = min(self.n_blocks - within, start + count - position)
            parts.append(self._permutation(epoch)[within:within + take])
            position += take
        return np.concatenate(parts)

    def micro_batches(self, consumed: int) -> list[np.ndarray]:
        """This rank's block indices for each micro batch of the step that starts after
        `consumed` samples (all ranks together)."""
        chunk = self.stream(consumed, self.global_batch)
        per_micro = self.micro_batch * self.dp_size
        return [chunk[m * per_micro + self.dp_rank * self.micro_batch:][:self.micro_batch]
                for m in range(self.global_batch // per_micro)]

    def epoch_of(self, consumed: int) -> int:
        return consumed // self.n_blocks


def eval_indices(n_blocks: int, micro_batch: int, dp_rank: int, dp_size: int, batches: int) -> list[np.ndarray]:
    """The same held-out blocks at every evaluation, split across ranks without overlap."""
    per_rank = min(batches, n_blocks // (micro_batch * dp_size)) * micro_batch
    mine = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [mine[i:i + micro_batch] for i in range(0, per_rank, micro_batch)]
