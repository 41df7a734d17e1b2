"""Evaluation: the model's predictions over the eval data, gathered from every rank, scored by
exact AUC, logloss, normalized entropy and calibration."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from recscale.comm.collectives import all_gather_rows
from recscale.data import Batch
from recscale.model import DLRM
from recscale.train.metrics import EvalMetrics, evaluate_predictions


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch], device: torch.device, group=None) -> EvalMetrics:
    """Metrics over every rank's predictions (gathered when ``group`` is given)."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in batches:
        batch = batch.to(device)
        logits.append(model(batch.dense, batch.sparse).float())
        labels.append(batch.labels.float())
    model.train(was_training)
    pred, lab = torch.cat(logits), torch.cat(labels)
    if group is not None:
        pair = torch.stack([pred, lab], dim=1)
        pair = torch.cat(all_gather_rows(pair, group, name="eval_gather"))
        pred, lab = pair[:, 0], pair[:, 1]
    return evaluate_predictions(pred.cpu(), lab.cpu())
