"""Calibration of a planted logistic model: expected AUC, bias for a positive rate."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tf_sfctr._checks import ArgumentTypeError


def sigmoid(z: np.ndarray) -> np.ndarray:
    """Logistic function, overflow-free.

    Example:
      >>> float(sigmoid(np.array(0.0)))
      0.5
    """
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def expected_auc(score: np.ndarray, probability: np.ndarray) -> float:
    """Expected AUC of ``score`` when each label is Bernoulli(``probability``).

    Ties in ``score`` count one half, as in the Mann-Whitney statistic.

    Example:
      >>> expected_auc(np.array([0.0, 1.0]), np.array([0.0, 1.0]))
      1.0
    """
    try:
        score = np.asarray(score, dtype=np.float64).reshape(-1)
        p = np.asarray(probability, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            "expected_auc: score and probability must be arrays of numbers, got "
            f"{type(score).__name__} and {type(probability).__name__}") from None
    if score.shape != p.shape:
        raise ValueError(f"expected_auc: score has {score.size} values and probability "
                         f"{p.size}; they need one per example")
    if np.isnan(score).any():
        raise ValueError("expected_auc: score must not hold NaN (it has no rank)")
    if not ((p >= 0.0) & (p <= 1.0)).all():
        raise ValueError("expected_auc: probability must hold numbers in [0, 1], got "
                         f"values from {np.nanmin(p) if p.size else 0} to "
                         f"{np.nanmax(p) if p.size else 0}{' and NaN' if np.isnan(p).any() else ''}")
    _, group = np.unique(score, return_inverse=True)
    pos = np.bincount(group, weights=p)
    neg = np.bincount(group, weights=1.0 - p)
    both = np.bincount(group, weights=p * (1.0 - p))
    neg_below = np.cumsum(neg) - neg
    numerator = np.dot(pos, neg_below) + 0.5 * (np.dot(pos, neg) - both.sum())
    denominator = pos.sum() * neg.sum() - both.sum()
    return float(numerator / denominator) if denominator > 0 else 0.5


def bias_for_rate(z: np.ndarray, rate: float) -> float:
    """Bias b with mean(sigmoid(b + z)) == rate (Newton, safeguarded).

    Example:
      >>> z = np.linspace(-2.0, 2.0, 101)
      >>> round(float(sigmoid(bias_for_rate(z, 0.2) + z).mean()), 6)
      0.2
    """
    lo, hi = -60.0, 60.0
    b = math.log(rate / (1.0 - rate)) - float(np.mean(z))
    for _ in range(100):
        s = sigmoid(b + z)
        err = float(s.mean()) - rate
        if abs(err) < 1e-12:
            break
        if err > 0:
            hi = min(hi, b)
        else:
            lo = max(lo, b)
        slope = float(np.mean(s * (1.0 - s)))
        step = b - err / slope if slope > 0 else 0.5 * (lo + hi)
        b = step if lo < step < hi else 0.5 * (lo + hi)
    return b


class Calibration(NamedTuple):
    """Scale ``k`` and bias ``b`` of the logit ``b + k * z`` and the AUC they give."""

    scale: float
    bias: float
    auc: float


def calibrate(z: np.ndarray, target_auc: float, positive_rate: float) -> Calibration:
    """Finds ``k > 0`` and ``b`` so that ``p = sigmoid(b + k * z)`` has mean
    ``positive_rate`` and expected AUC ``target_auc`` (labels ~ Bernoulli(p)).

    Raises:
      ValueError: ``target_auc`` is not reachable (e.g. ``z`` takes too few values).

    Example:
      >>> z = np.random.default_rng(0).normal(size=10_000)
      >>> c = calibrate(z, 0.75, 0.3)
      >>> round(c.auc, 3), round(float(sigmoid(c.bias + c.scale * z).mean()), 3)
      (0.75, 0.3)
    """
    z = np.sort(np.asarray(z, dtype=np.float64))

    def auc_at(scale: float) -> tuple[float, float]:
        b = bias_for_rate(scale * z, positive_rate)
        return expected_auc(z, sigmoid(b + scale * z)), b

    lo, hi = 0.0, 1.0
    while auc_at(hi)[0] < target_auc:
        lo, hi = hi, hi * 2.0
        if hi > 1e4:
            raise ValueError(
                f"target_auc={target_auc} is not reachable: these logits reach at "
                f"most AUC {auc_at(hi)[0]:.4f} (too few distinct feature values?)"
            )
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if auc_at(mid)[0] < target_auc:
            lo = mid
        else:
            hi = mid
    auc, bias = auc_at(hi)
    return Calibration(scale=hi, bias=bias, auc=auc)
