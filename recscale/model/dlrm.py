"""The DLRM model: bottom MLP, table-batched embedding bags, dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recscale.embedding import TableBatchedEmbeddingBags
from recscale.model.interaction import DotInteraction
from recscale.model.mlp import MLP
from recscale.sparse import JaggedBatch


class DLRM(nn.Module):
    """Returns logits ``[B]``. The embedding module updates itself in backward; the dense part
    (``dense_parameters()``) is trained by a standard ``torch.optim`` optimizer."""

    def __init__(
        self,
        embeddings: TableBatchedEmbeddingBags,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
    ) -> None:
        super().__init__()
        dims = set(embeddings.feature_dims)
        if len(dims) != 1:
            raise ValueError(f"dot interaction needs one embedding dim for every feature, got {sorted(dims)}")
        dim = dims.pop()
        if bottom_mlp[-1] != dim:
            raise ValueError(
                f"model.bottom_mlp must end with the embedding dim {dim} (got {list(bottom_mlp)}); "
                "the interaction takes dot products of equal-length vectors"
            )
        if top_mlp[-1] != 1:
            raise ValueError(f"model.top_mlp must end with 1 output (the logit), got {list(top_mlp)}")
        self.embeddings = embeddings
        self.bottom = MLP(num_dense, bottom_mlp)
        self.interaction = DotInteraction(len(embeddings.feature_names) + 1, dim)
        self.top = MLP(self.interaction.out_features, top_mlp, final_activation=False)

    def forward(self, dense: torch.Tensor, sparse: JaggedBatch) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse)
        return self.top(self.interaction(x, pooled)).squeeze(1)

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("embeddings.")]
