"""Embedding tables: configs, sparse optimizers, row storage and the table-batched operator."""

from recscale.embedding.config import TableConfig
from recscale.embedding.optimizers import OPTIMIZERS, SGD, Adagrad, Adam, RowWiseAdagrad, SparseOptimizer, make_optimizer
from recscale.embedding.storage import DenseRowStorage, RowStorage
from recscale.embedding.table_batched import TableBatchedEmbeddingBags

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "DenseRowStorage",
    "RowStorage",
    "RowWiseAdagrad",
    "SparseOptimizer",
    "TableBatchedEmbeddingBags",
    "TableConfig",
    "make_optimizer",
]
