"""Fixed-length blocks from a token file, and the deterministic order in which ranks read them.

The blocks form one endless stream: a seeded permutation of all blocks per epoch, epoch after
epoch. An optimizer step takes the next `global_batch` blocks of the stream, split into micro
batches and data-parallel ranks. The position in the stream (samples consumed) is all the
state there is: a resumed run reads exactly the blocks the uninterrupted one would have, with
any micro-batch / grad-accum / rank layout, and every layout of the same global batch gives
each optimizer step the same set of samples.

A mixture of sources (`data=mixture`) keeps that contract: each stream position is assigned
a source by a seeded shuffle of a fixed pattern that holds every source in proportion to its
weight, and each source's own blocks are drawn from its own endless per-epoch permutation.
"""

from dataclasses import dataclass

import numpy as np
import torch

from lmrepo.config.data import MIXTURE_PERIOD


class TokenBlocks:
    """Non-overlapping `block_size`-token windows of a memory-mapped token stream, and where
    documents start within them (`starts`: the stream's sorted document starts, when asked for)."""

    def __init__(self, tokens: np.ndarray, block_size: int, starts: np.ndarray | None = None):
        self.tokens, self.block_size, self.starts = tokens, block_size, starts

    def __len__(self) -> int:
        return len(self.tokens) // self.block_size

    def row(self, index: int) -> np.ndarray:
        return self.tokens[index * self.block_size : (index + 1) * self.block_size]

    def get(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.row(i) for i in indices]).astype(np.int64))

    def document_starts(self, index: int) -> np.ndarray:
        """The positions within the block (1 .. block_size - 1) at which a document starts."""
        first = index * self.block_size
        lo, hi = np.searchsorted(self.starts, [first + 1, first + self.block_size])
        return np.asarray(self.starts[lo:hi], dtype=np.int64) - first


class MixtureBlocks(TokenBlocks):
    """Several sources' blocks as one index space: source k holds [offsets[k], offsets[k + 1])."""

    def __init__(self, parts: list[TokenBlocks]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _part(self, index: int) -> tuple[TokenBlocks, int]:
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[k], index - int(self.offsets[k])

    def row(self, index: int) -> np.ndarray:
        part, within = self._part(index)
        return part.row(within)

    def document_starts(self, index: int) -> np.ndarray:
        part, within = self._part(index)
        return part.document_starts(within)


# The permutation each stream drew last, by (length, stream seed): (epoch, permutation).
_LATEST_PERMUTATION: dict[tuple, tuple[int, np.ndarray]] = {}


def seeded_permutation(n: int, stream: tuple[int, ...], epoch: int) -> np.ndarray:
    """A permutation of range(n) drawn from the seed (*stream, epoch), read-only. Each stream keeps
    the one it drew last: every step of an epoch reads the same one, and drawing it anew costs a
    pass over all blocks (~5 ms at 100k blocks, a tenth of a small model's step), while keeping
    only the latest per stream holds memory to one permutation per source, epoch after epoch."""
    latest = _LATEST_PERMUTATION.get((n, stream))
    if latest is None or latest[0] != epoch:
        permutation = np.random.default_rng([*stream, epoch]).permutation(n)
        permutation.flags.writeable = False
        latest = _LATEST_PERMUTATION[(n, stream)] = (epoch, permutation)
    return latest[1]


def periodic(start: int, count: int, period: int, cycle) -> np.ndarray:
    """Positions [start, start + count) of the endless sequence cycle(0), cycle(1), ..., each of length `period`."""
    parts, position = [np.empty(0, dtype=np.int64)], start
    while position < start + count:
        index, within = divmod(position, period)
        take = min(period - within, start + count - position)
        parts.append(cycle(index)[within : within + take])
        position += take
    return np.concatenate(parts)


@dataclass(frozen=True)
class SampleOrder:
    n_blocks: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int

    def _permutation(self, epoch: int) -> np.ndarray:
        return seeded_permutation(self.n_blocks, (self.seed,), epoch)

    def stream(self, start: int, count: int) -> np.ndarray:
        """Block indices at stream positions [start, start + count), across epoch boundaries."""
        return periodic(start, count, self.n_blocks, self._permutation)

    def micro_batches(self, consumed: int) -> list[np.ndarray]:
        """This rank's block indices for each micro batch of the step that starts after
        `consumed` samples (all ranks together)."""
        chunk = self.stream(consumed, self.global_batch)
        per_micro = self.micro_batch * self.dp_size
        return [
            chunk[m * per_micro + self.dp_rank * self.micro_batch :][: self.micro_batch]
            for m in range(self.global_batch // per_micro)
        ]

    def epoch_of(self, consumed: int) -> int:
        return consumed // self.n_blocks


def quotas(weights, total: int) -> np.ndarray:
    """`total` split in proportion to `weights` by largest remainder: the counts sum to `total`."""
    exact = np.asarray(weights, dtype=np.float64) / np.sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: total - counts.sum()]] += 1
    return counts


@dataclass(frozen=True)
class MixtureOrder(SampleOrder):
    """The stream of a mixture: block indices of a MixtureBlocks, sources drawn by weight.
    `n_blocks` is the total; an "epoch" (epoch_of) is that many samples, while each source runs
    through its own epochs at the pace its weight sets."""

    sizes: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def __post_init__(self):
        assert sum(self.sizes) == self.n_blocks and len(self.sizes) == len(self.weights) > 0 and min(self.sizes) > 0

    @property
    def _counts(self) -> np.ndarray:
        return quotas(self.weights, MIXTURE_PERIOD)

    def _pattern(self, index: int) -> np.ndarray:
        """The source of each position of the index-th period: a seeded shuffle of the weighted counts."""
        counts = self._counts
        return np.repeat(np.arange(len(counts)), counts)[seeded_permutation(MIXTURE_PERIOD, (self.seed, 0), index)]

    def _drawn_before(self, source: int, position: int) -> int:
        """How many of the first `position` samples came from `source`."""
        index, within = divmod(position, MIXTURE_PERIOD)
        return index * int(self._counts[source]) + int(np.count_nonzero(self._pattern(index)[:within] == source))

    def _source_permutation(self, source: int, epoch: int) -> np.ndarray:
        return seeded_permutation(self.sizes[source], (self.seed, 1 + source), epoch)

    def stream(self, start: int, count: int) -> np.ndarray:
        chosen = periodic(start, count, MIXTURE_PERIOD, self._pattern)
        out = np.empty(count, dtype=np.int64)
        offset = 0
        for k, size in enumerate(self.sizes):
            where = np.flatnonzero(chosen == k)
            # The positions a source gets in [start, start + count) are consecutive in its own stream.
            first = self._drawn_before(k, start)
            out[where] = offset + periodic(first, len(where), size, lambda e, k=k: self._source_permutation(k, e))
            offset += size
        return out


def eval_indices(sizes, weights, micro_batch: int, dp_rank: int, dp_size: int, batches: int) -> list[np.ndarray]:
    """The same held-out blocks at every evaluation, split across ranks without overlap. A
    mixture evaluates on the first blocks of each source's held-out split in proportion to the
    weights (a source with fewer held-out blocks than its share repeats them, so the weights hold)."""
    per_rank = min(batches, sum(sizes) // (micro_batch * dp_size)) * micro_batch
    offsets = np.cumsum([0, *sizes])
    chosen = np.concatenate(
        [offsets[k] + np.arange(n) % sizes[k] for k, n in enumerate(quotas(weights, per_rank * dp_size))]
    )
    mine = chosen[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [mine[i : i + micro_batch] for i in range(0, per_rank, micro_batch)]
