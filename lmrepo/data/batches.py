"""Fixed-length blocks from a token file, and the deterministic order in which ranks read them.

The order is a pure function of (seed, step): optimizer step k uses the k-th run of
`global_batch` blocks of a seeded permutation (a new permutation each epoch), split into
micro batches and data-parallel ranks. So a resumed run reads exactly the blocks the
uninterrupted one would have, with any micro-batch / grad-accum / rank layout of the same
global batch, and every optimizer step sees the same set of samples in every layout.
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
class StepOrder:
    n_blocks: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.n_blocks // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's block indices for each micro batch of optimizer step `step` (0-based)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        chunk = self._permutation(epoch)[within * self.global_batch:(within + 1) * self.global_batch]
        per_micro = self.micro_batch * self.dp_size
        return [chunk[m * per_micro + self.dp_rank * self.micro_batch:][:self.micro_batch]
                for m in range(self.global_batch // per_micro)]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


def eval_indices(n_blocks: int, micro_batch: int, dp_rank: int, dp_size: int, batches: int) -> list[np.ndarray]:
    """The same held-out blocks at every evaluation, split across ranks without overlap."""
    per_rank = min(batches, n_blocks // (micro_batch * dp_size)) * micro_batch
    mine = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [mine[i:i + micro_batch] for i in range(0, per_rank, micro_batch)]
