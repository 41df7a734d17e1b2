"""recscale: fast, readable training of large deep learning recommendation models on PyTorch."""

__version__ = "0.1.0"
