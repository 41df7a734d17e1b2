"""The per-step schedule: one training step, and the pipeline that prepares the next batch
while the current one computes.

With the pipeline on, batch i+1 has been fetched from the loader (whose workers load and
collate it), moved to the device and validated one iteration earlier, and, with several
ranks, its ids are sent to their owners (the input all-to-all of the embedding module's
``start_input_dist``) as soon as batch i-1 has trained, before batch i+2 is fetched; so the id
exchange runs in the background while the next batch loads and during batch i's forward and
backward. Every rank runs the same program, so the collectives start in the same
order everywhere. The results are bitwise those of the unpipelined loop: the same tensors meet
the same operators, only earlier.

With tables on the SSD tier and ``lookahead`` k, the rows batches i+1..i+k look up are
announced to the tier (and read in the background) before batch i trains. A rank looks up the
ids it receives from the input all-to-all, so on several ranks the pipeline runs one batch
further ahead: batches i+1..i+k have arrived and are announced while batch i+k+1's ids still
travel during batch i, so the id exchange keeps its overlap and the tier its k batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from recscale.comm.dense_sync import DenseGradSync
from recscale.data import Batch
from recscale.embedding.module import EmbeddingInput, EmbeddingModule
from recscale.embedding.tier_hooks import announce_batch, begin_batch, forget_announced, uses_tiers
from recscale.model import DLRM

Prepared = tuple[Batch, EmbeddingInput]  # the batch and its ids as the model's embeddings take them (maybe in flight)


class TrainPipeline:
    """Iterate ``(batch, sparse input)`` pairs, preparing one batch ahead when ``enabled``.

    Call ``close()`` (or use ``contextlib.closing``) when stopping early, so an id exchange
    already started for the next batch is waited for rather than left dangling.
    """

    def __init__(self, batches: Iterable[Batch], embeddings: EmbeddingModule, device: torch.device, enabled: bool = True,
                 lookahead: int = 1):
        """``lookahead``: with tables on the SSD tier, batches whose rows are announced to it
        (and read in the background) ahead of the one training."""
        self._batches = batches
        self._embeddings = embeddings
        self._device = device
        self._enabled = enabled
        self._tiered = enabled and lookahead > 0 and uses_tiers(embeddings)
        self._lookahead = max(1, lookahead) if self._tiered else 1
        # Ids that travel are announced once they arrive: one batch more ahead keeps one in flight.
        self._travels = self._tiered and getattr(embeddings, "world", 1) > 1
        self._depth = self._lookahead + int(self._travels)
        self._ahead: deque[Prepared] = deque()
        self._announced = 0  # leading batches of ``_ahead`` already announced to the tier

    def _load(self, batch: Batch) -> Batch:
        batch = batch.to(self._device, non_blocking=True)
        self._embeddings.validate(batch.sparse)
        return batch

    def _prepare(self, batch: Batch) -> Prepared:
        batch = self._load(batch)
        return batch, self._embeddings.start_input_dist(batch.sparse)

    def _announce(self) -> None:
        """Announce the batch about to train and the ``lookahead`` after it, in order; their
        missing rows start loading now, while earlier batches train."""
        while self._announced < min(len(self._ahead), self._lookahead + 1):
            announce_batch(self._embeddings, self._ahead[self._announced][1].wait())
            self._announced += 1

    def __iter__(self) -> Iterator[Prepared]:
        it = iter(self._batches)
        if not self._enabled:
            for batch in it:
                yield self._prepare(batch)
            return
        if not self._tiered:
            yield from self._send_then_load(it)
            return
        for batch in it:
            self._ahead.append(self._prepare(batch))
            if len(self._ahead) > self._depth:
                # Batch i+1's ids start travelling (and up to i+k's rows loading) before batch i computes.
                yield self._next()
        while self._ahead:
            yield self._next()

    def _send_then_load(self, it: Iterator[Batch]) -> Iterator[Prepared]:
        """Batch i+1's ids start travelling as soon as batch i-1 has trained, before batch i+2
        is fetched: the exchange runs while the next batch loads (the training thread's own
        work where it collates batches itself, the link idle otherwise) and then during batch
        i's step, rather than starting after the load and sharing the link with batch i's
        pooled embeddings and gradients alone."""
        batch = next(it, None)
        loaded = self._load(batch) if batch is not None else None
        while loaded is not None:
            self._ahead.append((loaded, self._embeddings.start_input_dist(loaded.sparse)))
            batch = next(it, None)  # fetched and collated while those ids travel
            loaded = self._load(batch) if batch is not None else None
            if len(self._ahead) > 1:
                yield self._ahead.popleft()
        while self._ahead:
            yield self._ahead.popleft()

    def _next(self) -> Prepared:
        if self._tiered:
            self._announce()
            begin_batch(self._embeddings)
            self._announced -= 1
        return self._ahead.popleft()

    def close(self) -> None:
        """Finish exchanges started for batches that will not be trained."""
        while self._ahead:
            self._ahead.popleft()[1].wait()
        if self._tiered:  # a later pipeline announces its own batches
            forget_announced(self._embeddings)


def train_step(model: DLRM, batch: Batch, sparse: EmbeddingInput, dense_opt: torch.optim.Optimizer,
               sync: DenseGradSync) -> torch.Tensor:
    """Forward, backward (embedding rows are updated inside it), dense all-reduce and step.

    Returns the summed (not averaged) loss of this rank's samples, detached; no host sync."""
    logits = model(batch.dense, sparse)
    global_batch = sparse.global_batch_size
    # Sum over local samples / global batch: summing over ranks gives the global mean.
    loss_sum = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
    dense_opt.zero_grad(set_to_none=True)
    (loss_sum / global_batch).backward()
    sync.finish()
    dense_opt.step()
    return loss_sum.detach()
