"""The significance level and the goodness-of-fit test that every statistical test shares.

Statistical tests draw fixed-seed samples, so one platform gives the same p-values on every run.
Another platform (another torch version, other kernels, another device) may consume random numbers
differently and draw another sample: for a correct implementation each p-value is then uniform on
[0, 1], and each assertion fails with probability ``ALPHA``. The suite makes about 100 such
assertions, so the chance that a correct build fails somewhere (the family-wise false-alarm rate)
is about ``100 * ALPHA``: 10 % at the textbook 0.001, 0.1 % at ``ALPHA = 1e-5``.

The lower level costs little power: the samples are large (tens of thousands of rows), and the
negative controls, which run the same tests on a sampler with a known bias, reject it at p-values
below 1e-200 (the bias a bug makes is rarely subtler than theirs).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chi2

#: Significance level of every statistical assertion in the suite (see the module docstring).
ALPHA = 1e-5


def chi_square_pvalue(
    observed: torch.Tensor | np.ndarray,
    probs: torch.Tensor | np.ndarray,
    *,
    min_expected: float = 5.0,
) -> float:
    """P-value of Pearson's chi-square test that counts ``observed`` follow ``probs``.

    Both are ``[..., cells]``; each leading index is a stratum (a prompt, say) with its own
    distribution, compared with its own total count: statistics and degrees of freedom add up
    over strata. ``probs`` need not be normalised (a residual distribution is passed as
    weights). Within a stratum, cells expected fewer than ``min_expected`` counts are pooled
    into one, because the chi-square approximation of the statistic needs about five per cell.
    A count in a cell of probability 0 fails at once: that outcome is impossible, not unlikely.
    A stratum with a single possible outcome adds nothing (there is nothing to test), and with
    nothing to test at all the p-value is 1.
    """
    counts = np.asarray(observed, dtype=np.float64)  # [..., C]
    weights = np.asarray(probs, dtype=np.float64)  # [..., C]
    if counts.shape != weights.shape:
        raise ValueError(f"observed {counts.shape} and probs {weights.shape} differ in shape")
    stat, dof = 0.0, 0
    for row, weight in zip(
        counts.reshape(-1, counts.shape[-1]), weights.reshape(-1, weights.shape[-1]), strict=True
    ):
        assert row[weight == 0].sum() == 0, "an outcome of probability 0 occurred"
        expected = weight / weight.sum() * row.sum()  # [C]
        small = expected < min_expected
        cells = np.append(row[~small], row[small].sum())
        means = np.append(expected[~small], expected[small].sum())
        possible = means > 0  # the pooled cell is empty when no cell is small
        stat += float(((cells[possible] - means[possible]) ** 2 / means[possible]).sum())
        dof += max(int(possible.sum()) - 1, 0)
    return float(chi2.sf(stat, dof)) if dof else 1.0
