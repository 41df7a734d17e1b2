"""The DLRM model: bottom MLP, table-batched embedding bags, dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recscale.embedding.module import EmbeddingInput, EmbeddingModule
from recscale.model.interaction import DotInteraction
from recscale.model.mlp import MLP
from recscale.sparse import JaggedBatch


class DLRM(nn.Module):
    """Returns logits ``[B]``. The embedding module updates itself in backward; the dense part
    (``dense_parameters()``) is trained by a standard ``torch.optim`` optimizer."""

    def __init__(
        self,
        embeddings: EmbeddingModule,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        mlp_precision: str = "fp32",
    ) -> None:
        """``mlp_precision="bf16"`` runs the MLPs and the interaction in bf16 (autocast: bf16
        matmuls, fp32 master weights and gradients); the embeddings and the loss stay fp32."""
        super().__init__()
        if mlp_precision not in ("fp32", "bf16"):
            raise ValueError(f"mlp_precision must be 'fp32' or 'bf16', got {mlp_precision!r}")
        self.mlp_precision = mlp_precision
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

    def forward(self, dense: torch.Tensor, sparse: JaggedBatch | EmbeddingInput) -> torch.Tensor:
        # Sharded, the bottom MLP runs while the pooled outputs travel.
        pending = self.embeddings.start_forward(sparse)
        if self.mlp_precision == "fp32":
            x = self.bottom(dense)
            return self.top(self.interaction(x, pending.finish())).squeeze(1)
        with torch.autocast(dense.device.type, dtype=torch.bfloat16):
            x = self.bottom(dense)
            with torch.autocast(dense.device.type, enabled=False):
                pooled = pending.finish()
            logits = self.top(self.interaction(x, pooled))
        return logits.squeeze(1).float()

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("embeddings.")]
