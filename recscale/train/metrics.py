"""Click-prediction metrics computed exactly over a whole evaluation set."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class EvalMetrics:
    auc: float
    logloss: float
    ne: float  # normalized entropy: logloss / entropy of the observed click rate
    calibration: float  # mean predicted click rate / observed click rate
    num_samples: int

    def as_dict(self, prefix: str = "eval_") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores given their average rank)."""
    scores = scores.double().flatten()
    labels = labels.double().flatten()
    n_pos = float(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = torch.sort(scores)
    sorted_labels = labels[order]
    # Average rank per group of tied scores.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2.0
    ranks = avg_rank[inverse]
    rank_sum_pos = float((ranks * sorted_labels).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy from logits (numerically stable)."""
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def evaluate_predictions(logits: torch.Tensor, labels: torch.Tensor) -> EvalMetrics:
    labels = labels.double().flatten()
    logits = logits.double().flatten()
    ll = log_loss(logits, labels)
    p = float(labels.mean())
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else float("nan")
    mean_pred = float(torch.sigmoid(logits).mean())
    return EvalMetrics(
        auc=roc_auc(logits, labels),
        logloss=ll,
        ne=ll / entropy if entropy == entropy else float("nan"),
        calibration=mean_pred / p if p > 0 else float("nan"),
        num_samples=int(labels.numel()),
    )
