"""How the tests compare floating-point results: the unit roundoffs, the tolerances built from them,
and `assert_close`, the one comparison every numeric check of the suite goes through.

Two computations of one quantity that differ only in the order of their sums (another kernel's
blocking or vector width, another thread or rank split, another CPU) differ by rounding. Each
addition rounds by at most half a unit in the last place of the partial sum, in a direction no
kernel chooses, so the roundings of a sum of n terms add up like a random walk: ~sqrt(n) units
roundoff u relative to the terms' size. The worst case, n·u, needs every rounding to go the same
way, which no real kernel approaches. Such a bound holds for a quantity as a whole (a loss, a
tensor by its norm), not for each element of a tensor: an element of a gradient may be the nearly
cancelling sum of many terms, whose own relative error has no bound at all. That is why nothing
here is compared element by element: one CPU's kernels pass a per-element tolerance and
another's do not (a gradient of 1.6-3.2M elements, a packed row against a document alone: 1e-6
absolute per element held on a Xeon, not on a Zen 5 EPYC).

`make test ARGS=--tolerance-report=FILE` appends every comparison's worst relative difference and
its tolerance to FILE: how much room each tolerance leaves on this machine's kernels.
"""

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

FP32 = 2.0**-24  # unit roundoff: the largest relative error of one rounding to fp32
VOCAB = 50257  # GPT-2's vocabulary: the longest sum of every step (the softmax, the LM head's backward)

# Losses of the same fp32 job on two layouts (ranks, stages, engines, shards) over a few optimizer
# steps. Step 1's loss is a mean of 128-256 per-token losses (TINY), sqrt(256)·u = 1e-6 relative
# when summed in another order; each update then carries the gradient's rounding (reduced across
# ranks in another order) into the weights, and Adam turns a near-zero gradient element's rounding
# into a full-size step for it. 1e-5 leaves ten times the first step's rounding for that. What it
# catches: a gradient off by a factor, a skipped micro batch or a wrong learning rate moves the loss
# by 1e-3 or more after one update (one step moves it by ~1e-2).
STEPS_FP32 = 1e-5
# Losses of two layouts that put every micro batch through the same kernels on the same shapes and
# differ only in how one weight's gradient contributions are added (a pipeline adds the tied
# embedding's two uses on each stage, then across stages; one process its micro batches in
# another order): one rounding per element and step, which Adam passes on one to one where the
# gradient is not near zero. The loss's own mean (256 terms, sqrt(256)·u = 1e-6) is the bound, and
# it catches what moves the loss less than STEPS_FP32 can see: clipping by one stage's norm alone
# (1.3e-5 at step 6), one chunk's gradient scaled twice (3e-5 after one update).
PIPELINE_FP32 = 1e-6
# The same in bf16 (fp32 master weights, bf16 activations and gradient reductions): one rounding is
# 2**-8 = 0.4% and a reduction in another order moves a gradient element by about that much, compounded
# over a few steps: 2e-2 relative (5 bf16 roundings). A factor-of-2 gradient moves the loss more.
STEPS_BF16 = 2e-2
# The global gradient norm past step 1 of such runs: dominated by the 50,257-row embedding, whose rows
# for tokens a batch does not hold get tiny gradients that Adam's per-element scaling turns into
# full-size updates, so one step's rounding shows in the next steps' norms by 1e-4 to 4e-4 relative
# in every layout, one process with 2-8 accumulated micro batches too. 1e-3 catches a gradient off by
# a factor (a rank count, an accumulation count: 50% or more) and a loss scaled twice in one chunk (4%).
NORM_STEPS = 1e-3


def reordered_sum(n: int) -> float:
    """The relative difference to allow between two computations of a result whose longest sum
    (of n terms) is added in another order: 4·sqrt(n)·u, the random walk above with room for the
    two computations' independent roundings (sqrt 2) and the shorter sums before and after the
    longest one. A result that depends on n terms can be no closer than its rounding allows; a
    tolerance tighter than this holds on one CPU's kernels and fails on another's."""
    return 4 * math.sqrt(n) * FP32


def differences(actual, expected, where: str = ""):
    """(relative difference, where) of each compared quantity: for a number |a - b| / |b|, for a
    tensor ||a - b|| / ||b|| (its norm, see above); sequences and mappings item by item."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.shape == expected.shape, (where, actual, expected.shape)
        a, b = actual.detach().double(), expected.detach().double()
        yield float((a - b).norm() / b.norm()) if b.norm() else float((a - b).norm()), where
    elif isinstance(expected, Mapping):
        assert actual.keys() == expected.keys() and expected, (where, sorted(actual), sorted(expected))
        for key in expected:
            yield from differences(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, Sequence) and not isinstance(expected, str):
        assert len(actual) == len(expected) > 0, (where, actual, expected)
        for i, (a, b) in enumerate(zip(actual, expected)):
            yield from differences(a, b, f"{where}[{i}]")
    else:
        yield (abs(actual - expected) / abs(expected) if expected else abs(actual)), where


def relative_difference(actual, expected) -> float:
    """The worst relative difference between two results (see `differences`)."""
    return max(d for d, _ in differences(actual, expected))


def assert_close(actual, expected, rel: float, what: str = "") -> float:
    """Every quantity of `actual` within `rel` of `expected`, relative (see `differences`): returns
    the worst difference, and names where it is when it is too large."""
    worst, where = max(differences(actual, expected), key=lambda d: d[0])
    if REPORT:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" ", 1)[0]
        with open(REPORT, "a") as f:  # one short appended line: whole even with two workers
            f.write(f"{worst:.3g}\t{rel:.3g}\t{worst / rel:.3g}\t{test}\t{what}\n")
    if worst > rel:
        shown = "" if isinstance(expected, (torch.Tensor, Mapping)) else f":\n{actual}\n{expected}"
        raise AssertionError(f"{what or 'results'}{where} differ by {worst:.3g} relative (> {rel:.3g}){shown}")
    return worst


REPORT: Path | None = None  # set by conftest from --tolerance-report
