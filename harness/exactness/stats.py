"""The statistics of the check: the G-test, its power against a total variation, Holm's
correction, and bounds on the cell-level TV (scipy.stats for the distributions)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats
from scipy.optimize import brentq

POWER = 0.8  # the detectable TV is the one caught this often


def g_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(G statistic, degrees of freedom, p-value) of counts [C] against cell probabilities [C]."""
    n = counts.sum()
    if len(probs) < 2 or n == 0:
        return 0.0, 0, 1.0
    expected = n * probs / probs.sum()
    statistic, p_value = stats.power_divergence(counts, expected, lambda_="log-likelihood")
    return float(statistic), len(probs) - 1, float(p_value)


def noncentrality_for_power(df: int, level: float, power: float = POWER) -> float:
    """lambda* such that a level-`level` chi-square test with df degrees of
    freedom rejects a noncentral chi-square(df, lambda*) with probability `power`."""
    critical = stats.chi2.isf(level, df)

    def shortfall(lam):
        return stats.ncx2.sf(critical, df, lam) - power

    high = 1.0
    while shortfall(high) < 0:
        high *= 2
    return brentq(shortfall, 1e-9, high)


def detectable_tv(n: int, df: int, level: float, power: float = POWER) -> float | None:
    """Smallest cell-level TV caught with probability `power` in every direction: sqrt(lambda*/4n)."""
    if df < 1 or n < 1:
        return None
    return math.sqrt(noncentrality_for_power(df, level, power) / (4 * n))


def samples_for_tv(tv: float, df: int, level: float, power: float = POWER) -> int:
    """Smallest n with detectable_tv(n, df, level) <= tv."""
    return math.ceil(noncentrality_for_power(max(df, 1), level, power) / (4 * tv * tv))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values: reject the i-th when its adjusted value is below alpha.
    Valid whatever the dependence between the tests (ours are strongly dependent)."""
    m = len(p_values)
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def tv_upper_bound(statistic: float, df: int, n: int, confidence: float = 0.95) -> float | None:
    """An upper confidence bound on the cell-level TV, by inverting the G-test.

    Under a sampler whose cell law r differs from the exact law pi, G is
    (asymptotically) noncentral chi-square with noncentrality
    lambda = 2 n KL(r || pi) >= 4 n TV^2 (Pinsker). The largest lambda
    under which a G this small still has probability 1 - confidence bounds
    lambda, hence TV <= sqrt(lambda_upper / 4n). A bootstrap interval of the
    plug-in TV does not do this job: the plug-in is biased upward by noise,
    and so are its resamples.
    """
    if df < 1 or n < 1:
        return None
    tail = 1 - confidence
    if stats.chi2.cdf(statistic, df) <= tail:  # even lambda = 0 makes G look too small
        return 0.0

    def excess(lam):
        return stats.ncx2.cdf(statistic, df, lam) - tail

    high = max(1.0, statistic)
    while excess(high) > 0:
        high *= 2
    return min(1.0, math.sqrt(brentq(excess, 0.0, high) / (4 * n)))


def tv_estimate(counts: np.ndarray, probs: np.ndarray, statistic: float, df: int, seed: int, resamples: int = 2000) -> dict:
    """The plug-in total variation between observed and exact cell laws, the
    range the same estimate takes when the sampler is exact (it is biased
    upward by noise: read it against `exact_median` and `exact_95`), and a
    95% upper confidence bound on the TV (`tv_upper_bound`)."""
    n = int(counts.sum())
    probs = probs / probs.sum()

    def tv(c):
        return 0.5 * np.abs(c / n - probs).sum(-1)

    exact = tv(np.random.default_rng(seed).multinomial(n, probs, size=resamples))  # [resamples]
    return {
        "tv": float(tv(counts)),
        "upper95": tv_upper_bound(statistic, df, n),
        "exact_median": float(np.median(exact)),
        "exact_95": float(np.quantile(exact, 0.95)),
    }
