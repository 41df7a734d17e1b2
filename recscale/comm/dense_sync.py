"""Data-parallel dense gradients: bucketed all-reduce that starts during backward.

Each parameter's gradient hook marks it ready; when every parameter of a bucket is ready the
bucket is flattened (in the wire precision) and its all-reduce is launched asynchronously, so
communication overlaps the rest of backward. ``finish()`` waits and writes the sums back.
Gradients are summed, not averaged: the loss on each rank is already divided by the global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from recscale.comm.collectives import CommStats, all_reduce_sum

_WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DenseGradSync:
    def __init__(
        self,
        params: list[nn.Parameter],
        group,
        precision: str = "fp32",
        loss_scale: float = 1024.0,
        stats: CommStats | None = None,
        bucket_bytes: int = 4 << 20,
    ) -> None:
        if precision not in _WIRE:
            raise ValueError(f"dense all-reduce precision must be one of {sorted(_WIRE)}, got {precision!r}")
        self.group = group
        self.dtype = _WIRE[precision]
        self.scale = loss_scale if precision == "fp16" else 1.0
        self.stats = stats
        self.params = [p for p in params if p.requires_grad]
        # Buckets in reverse order: the last layers' gradients are ready first.
        self.buckets: list[list[nn.Parameter]] = []
        current, size = [], 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * 4
            if size >= bucket_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._ready = [0] * len(self.buckets)
        self._pending: list[tuple[int, torch.Tensor, object]] = []
        if group is not None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._bucket_of[id(p)]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.scale != 1.0:
            flat = flat * self.scale
        wire = flat.to(self.dtype)
        work = all_reduce_sum(wire, self.group, self.stats, "dense_allreduce", async_op=True)
        self._pending.append((i, wire, work))

    def finish(self) -> None:
        """Wait for every bucket (launching any whose hooks did not all fire) and write back."""
        if self.group is None:
            return
        launched = {i for i, _, _ in self._pending}
        for i in range(len(self.buckets)):
            if i not in launched:
                self._launch(i)
        for i, wire, work in sorted(self._pending, key=lambda x: x[0]):
            if self.stats is not None:
                with self.stats.timed("dense_allreduce"):
                    work.wait()
            else:
                work.wait()
            flat = wire.float()
            if self.scale != 1.0:
                flat = flat / self.scale
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
