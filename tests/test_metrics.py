import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.train.metrics import evaluate_predictions, roc_auc


def _auc_pairs(scores, labels):
    """O(n^2) definition: P(score_pos > score_neg) + 0.5 P(tie)."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(-5, 5), st.integers(0, 1)), min_size=2, max_size=60))
def test_auc_equals_pairwise_definition_with_ties(pairs):
    scores = [float(s) for s, _ in pairs]
    labels = [y for _, y in pairs]
    if len(set(labels)) < 2:
        assert math.isnan(roc_auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32)))
        return
    got = roc_auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32))
    assert abs(got - _auc_pairs(scores, labels)) < 1e-12


def test_constant_prediction_has_ne_one_and_calibration_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0] * 25)
    p = labels.mean()
    logits = torch.full_like(labels, math.log(p / (1 - p)))
    m = evaluate_predictions(logits, labels)
    assert abs(m.ne - 1.0) < 1e-6
    assert abs(m.calibration - 1.0) < 1e-6
    assert abs(m.logloss - (-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))) < 1e-9
    assert m.auc == 0.5


def test_perfect_ranking_auc_one():
    m = evaluate_predictions(torch.tensor([-3.0, -1.0, 2.0, 4.0]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert m.auc == 1.0
    assert m.ne < 1.0
