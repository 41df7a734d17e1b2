"""Jagged sparse input: the batch type every layer above consumes."""

from recscale.sparse.jagged import JaggedBatch, SparseInputError, permute_bags

__all__ = ["JaggedBatch", "SparseInputError", "permute_bags"]
