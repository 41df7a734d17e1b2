"""Jagged sparse input: the batch type every layer above consumes."""

from recscale.sparse.jagged import JaggedBatch, SparseInputError

__all__ = ["JaggedBatch", "SparseInputError"]
