"""Data: the Batch type, Criteo readers, the synthetic generator and the batch loader."""

from recscale.data.batch import Batch
from recscale.data.criteo import ClickData, read_criteo_tsv, read_encoded_csv, vocab_encode
from recscale.data.errors import DataFormatError
from recscale.data.loader import ClickBatches, make_loader
from recscale.data.synthetic import SyntheticClickData, SyntheticConfig

__all__ = [
    "Batch",
    "ClickBatches",
    "ClickData",
    "DataFormatError",
    "SyntheticClickData",
    "SyntheticConfig",
    "make_loader",
    "read_criteo_tsv",
    "read_encoded_csv",
    "vocab_encode",
]
