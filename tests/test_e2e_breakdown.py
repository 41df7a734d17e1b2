"""benchmarks/e2e.py's time breakdown names each profiled operator's part of the step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _e2e_profile import _category  # noqa: E402


def test_embedding_operators_forward_and_backward_count_as_embeddings() -> None:
    # The native operator's backward is the fused row update: embedding work, not "other".
    for name in ("_NativeFusedPooling", "_NativeFusedPoolingBackward", "_FusedPooling", "_FusedPoolingBackward",
                 "autograd::engine::evaluate_function: _NativeFusedPoolingBackward"):
        assert _category(name) == "embeddings", name
    assert _category("aten::binary_cross_entropy_with_logits") == "mlp"
    assert _category("_CrossLayersBackward") == "mlp"  # DCNv2's fused backward is dense work
    assert _category("comm:output_a2a") == "comm"
    assert _category("aten::view") is None  # left to its enclosing event, else "other"
