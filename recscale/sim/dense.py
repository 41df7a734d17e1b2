"""The dense part of a DLRM step on one rank: FLOPs and operator counts of the bottom MLP, the
dot interaction and the top MLP for a local batch, and the parameters the all-reduce carries."""

from __future__ import annotations

from dataclasses import dataclass

from recscale.sim.topology import DenseCompute


@dataclass(frozen=True)
class DenseModel:
    bottom: tuple[int, ...]  # layer widths, input first
    top: tuple[int, ...]
    vectors: int  # interaction inputs: the bottom MLP's output and one pooled vector per table
    dim: int

    @staticmethod
    def of(num_dense: int, bottom_mlp: list[int], top_mlp: list[int], tables: int, dim: int) -> DenseModel:
        n = tables + 1
        return DenseModel((num_dense, *bottom_mlp), (dim + n * (n - 1) // 2, *top_mlp), n, dim)

    @staticmethod
    def _matmul(widths: tuple[int, ...]) -> int:
        return sum(a * b for a, b in zip(widths, widths[1:]))

    def bottom_flops(self, batch: int) -> float:
        return 2.0 * batch * self._matmul(self.bottom)

    def top_flops(self, batch: int) -> float:
        """Interaction (a batched n x d by d x n product) and top MLP, forward."""
        return 2.0 * batch * (self.vectors * self.vectors * self.dim + self._matmul(self.top))

    @property
    def bottom_ops(self) -> int:
        return 2 * (len(self.bottom) - 1)  # linear + activation per layer

    @property
    def top_ops(self) -> int:
        return 2 * (len(self.top) - 1) + 6  # + concat, bmm, gather of pairs, loss

    @staticmethod
    def _params(widths: tuple[int, ...]) -> int:
        return sum(a * b + b for a, b in zip(widths, widths[1:]))

    @property
    def bottom_params(self) -> int:
        return self._params(self.bottom)

    @property
    def top_params(self) -> int:
        return self._params(self.top)

    @property
    def tensors(self) -> int:
        return 2 * (len(self.bottom) - 1 + len(self.top) - 1)

    def bottom_values(self, batch: int) -> float:
        """Activation values the bottom MLP writes (memory traffic beyond its FLOPs)."""
        return float(batch * sum(self.bottom[1:]))

    def top_values(self, batch: int) -> float:
        """The interaction's inputs, products and pairs, and the top MLP's activations."""
        return float(batch * (2 * self.vectors * self.dim + self.vectors * self.vectors + sum(self.top)))

    def time_s(self, flops: float, values: float, ops: int, c: DenseCompute) -> float:
        return flops / c.flops_per_s + values * c.value_s + ops * c.op_overhead_s


def bucket_groups(top_params: int, bottom_params: int, bucket_bytes: int = 4 << 20) -> list[tuple[int, bool]]:
    """The all-reduce buckets as ``comm.dense_sync`` fills them: 4 MiB of fp32 in reverse
    order of the parameters (the top MLP's first), each launched once all its gradients are
    there; per bucket its parameter count and whether it holds bottom-MLP parameters (so it
    waits for the bottom MLP's backward)."""
    out = []
    for start, params in _spans(top_params + bottom_params, bucket_bytes // 4):
        out.append((params, start + params > top_params))
    return out


def _spans(total: int, per: int) -> list[tuple[int, int]]:
    spans = [(i, min(per, total - i)) for i in range(0, total, per)]
    return spans or [(0, 0)]
