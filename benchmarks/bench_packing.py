"""Document masking's cost: training tokens/s of packed blocks whose documents are kept apart
(data.cross_document_attention=false) against plain packing, side by side in one run.

    python benchmarks/bench_packing.py          # GPT-2 tiny and Llama tiny, blocks of 128, 256, 512 (~4 min on 2 cores)
    python benchmarks/bench_packing.py --quick  # smoke run: one 2 x 64 model per family, blocks of 64 (<1 min)
    python benchmarks/bench_packing.py --save   # also writes benchmarks/results/bench_packing_<machine>_<yyyy-mm>.md

One process, one rank, fp32, the model train.py builds (lmrepo.models.build_model: transformers'
SDPA attention, no cache), AdamW; a step is forward, backward and optimizer step of one micro
batch of 4 blocks, the batch made in the step (lmrepo.data.loader.separate_documents included in
the masked side's time). Documents have random lengths (exponential, mean a quarter of the block:
about four per block, so nearly every block holds a boundary); the token ids are random too, which
costs nothing different. Plain packing lets SDPA run its causal kernel without a mask; kept apart,
transformers builds a boolean (block x block) mask per sample from the restarting position ids.
Sides alternate, each side's best of the rounds is reported (a shared machine slows some runs).
"""

import argparse
import time

import numpy as np
import torch

from common import Report, add_save_flag  # benchmarks/common.py, first on sys.path
from lmrepo.config import load
from lmrepo.data.loader import separate_documents
from lmrepo.models import build_model
from lmrepo.plan.compose import compose_config

MICRO_BATCH = 4
PRESETS = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}
QUICK_SHAPE = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64"]
QUICK_LLAMA = ["model.n_kv_head=2", "model.n_inner=128"]


def model(family: str, block: int, quick: bool):
    overrides = [f"model={PRESETS[family]}", f"model.n_positions={max(block, 64)}", f"data.block_size={block}"]
    if quick:
        overrides += QUICK_SHAPE + (QUICK_LLAMA if family == "llama" else [])
    torch.manual_seed(0)
    return build_model(load(compose_config(overrides)).model)


def batch(block: int, rng: np.random.Generator, apart: bool) -> dict:
    ids = torch.from_numpy(rng.integers(0, 50257, (MICRO_BATCH, block)))
    plain = {"input_ids": ids, "labels": ids}
    if not apart:
        return plain
    starts = []
    for _ in range(MICRO_BATCH):
        ends = np.cumsum(np.maximum(1, rng.exponential(block / 4, size=block)).astype(np.int64))
        starts.append(ends[ends < block])
    return separate_documents(plain, starts)


def tokens_per_s(net, optimizer, block: int, apart: bool, steps: int) -> float:
    rng = np.random.default_rng(0)
    for step in range(steps + 1):  # the first step warms up (allocations, kernels) and is not timed
        if step == 1:
            start = time.perf_counter()
        loss = net(**batch(block, rng, apart)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * MICRO_BATCH * block / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, blocks of 64, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side and round")
    add_save_flag(parser)
    args = parser.parse_args()
    report = Report(__file__, device="cpu")
    blocks = [64] if args.quick else [128, 256, 512]
    rounds = 1 if args.quick else args.rounds
    report.print("## Training tokens/s: documents kept apart vs plain packing")
    report.print("")
    report.print(
        f"fp32, one rank, micro batch {MICRO_BATCH}, AdamW; best of {rounds} alternating rounds of {args.steps} steps."
    )
    report.print("")
    report.print("| model | block | plain tokens/s | apart tokens/s | apart / plain |")
    report.print("| --- | ---: | ---: | ---: | ---: |")
    figures = []
    for family in PRESETS:
        for block in blocks:
            net = model(family, block, args.quick)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
            best = {False: 0.0, True: 0.0}
            for _ in range(rounds):
                for apart in (False, True):
                    best[apart] = max(best[apart], tokens_per_s(net, optimizer, block, apart, args.steps))
            ratio = best[True] / best[False]
            report.print(f"| {PRESETS[family]} | {block} | {best[False]:,.0f} | {best[True]:,.0f} | {ratio:.2f} |")
            figures.append(
                {
                    "model": PRESETS[family],
                    "block": block,
                    "plain_tokens_per_s": best[False],
                    "apart_tokens_per_s": best[True],
                    "ratio": ratio,
                }
            )
    report.save(args.save, {"micro_batch": MICRO_BATCH, "rounds": rounds, "steps": args.steps, "rows": figures})


if __name__ == "__main__":
    main()
