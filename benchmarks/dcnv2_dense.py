"""Benchmark: the dense part of DLRM-DCNv2 alone, and the Amdahl bound of the dcnv2 race.

The dcnv2 model (``e2e.py --configs dcnv2``) spends most of a step in its MLPs and cross layers,
which every system runs on PyTorch's own GEMMs. This times, in one process on the same threads,
one training step of each dense part on pre-pooled embeddings (bottom MLP, interaction, top MLP:
forward, backward including the pooled embeddings' gradient, dense Adagrad step):

* ``recscale dense``: recscale's ``DLRM`` (fused cross layers) over a stand-in embedding module
  that hands back the pooled tensor;
* ``plain dense``: ``e2e.py``'s plain-PyTorch model after its lookups;
* ``torchrec dense``: TorchRec's ``DLRM_DCN`` ``dense_arch``, ``inter_arch`` and ``over_arch``
  (no DistributedModelParallel around them);

and whole steps of ``e2e.py``'s ``torchrec`` (``DistributedModelParallel``, its planner),
``recscale`` and ``plain`` systems on the dcnv2 tables. Since no system can run its dense part faster than
the fastest of these, ``T(torchrec step) / T(recscale dense)`` bounds the speed-up over TorchRec
that any system sharing PyTorch's GEMMs can reach by making everything else free.

    python benchmarks/dcnv2_dense.py                   # fp32, 2 threads, about 2 minutes
    python benchmarks/dcnv2_dense.py --bf16 --repeats 3
    python benchmarks/dcnv2_dense.py --quick           # tiny tables and batch, seconds

Each figure is the best of ``--repeats`` timed rounds (``--steps`` steps each, systems taking
turns), wall clock and process CPU time; the process runs in ``e2e.py``'s worker environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _e2e_spec import ModelSpec, make_batches, make_spec  # noqa: E402
from _e2e_systems import DENSE_LR, EPS, PlainSystem, RecscaleSystem, maybe_bf16, torchrec_available  # noqa: E402
from torch import nn  # noqa: E402

from recscale.model import DLRM  # noqa: E402


class _Pooled:
    """A finished pooled output: the fixed pre-pooled tensor."""

    def __init__(self, pooled: torch.Tensor) -> None:
        self.pooled = pooled

    def finish(self) -> torch.Tensor:
        return self.pooled


class PooledStandIn(nn.Module):
    """Stands in for recscale's embedding module: ``start_forward`` yields a fixed pooled
    tensor (which takes a gradient, as real pooled outputs do); nothing is looked up."""

    def __init__(self, spec: ModelSpec, pooled: torch.Tensor) -> None:
        super().__init__()
        self.feature_names = tuple(f"s{i}" for i in range(spec.num_features))
        self.feature_dims = (spec.dim,) * spec.num_features
        self.pooled = pooled

    def start_forward(self, sparse: object) -> _Pooled:
        return _Pooled(self.pooled)


def _inputs(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b = spec.batch_size
    dense = torch.randn(b, spec.num_dense, generator=g)
    pooled = torch.randn(b, spec.num_features * spec.dim, generator=g).mul_(0.1).requires_grad_()
    labels = torch.randint(0, 2, (b,), generator=g).float()
    return dense, pooled, labels


def recscale_dense(spec: ModelSpec, bf16: bool) -> Callable[[], None]:
    """recscale's DLRM and dense optimizer, as ``train_step`` runs them, on pooled inputs."""
    from recscale.train.config import load_config
    from recscale.train.model_factory import build_dense_optimizer

    torch.manual_seed(0)
    dense, pooled, labels = _inputs(spec)
    model = DLRM(PooledStandIn(spec, pooled), spec.num_dense, spec.bottom, spec.top,  # type: ignore[arg-type]
                 "bf16" if bf16 else "fp32", spec.interaction, spec.dcn_layers, spec.dcn_low_rank)
    cfg = load_config(None, ["dense_optimizer.name=adagrad", f"dense_optimizer.lr={DENSE_LR}",
                             f"dense_optimizer.eps={EPS}"])
    opt = build_dense_optimizer(cfg, model.dense_parameters())

    def step() -> None:
        loss = F.binary_cross_entropy_with_logits(model(dense, None), labels, reduction="sum")  # type: ignore[arg-type]
        opt.zero_grad(set_to_none=True)
        pooled.grad = None
        (loss / spec.batch_size).backward()
        opt.step()

    return step


def plain_dense(spec: ModelSpec, bf16: bool) -> Callable[[], None]:
    """``e2e.py``'s plain-PyTorch DLRM after its lookups (tables of one row: never read)."""
    from _e2e_systems import _PlainDLRM

    torch.manual_seed(0)
    net = _PlainDLRM(dataclasses.replace(spec, table_rows=(1,) * spec.num_features))
    dense, pooled, labels = _inputs(spec)
    ly = list(pooled.split(spec.dim, dim=1))
    params = [p for n, p in net.named_parameters() if not n.startswith("embs.")]
    opt = torch.optim.Adagrad(params, lr=DENSE_LR, eps=EPS, fused=True)

    def step() -> None:
        with maybe_bf16(bf16):
            logits = net.dense_forward(dense, ly)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        pooled.grad = None
        loss.backward()
        opt.step()

    return step


def torchrec_dense(spec: ModelSpec, bf16: bool) -> Callable[[], None]:
    """TorchRec's DLRM_DCN dense, interaction and over arches (the embedding tables stay on
    the meta device: never allocated) with a dense Adagrad."""
    from _e2e_torchrec import _dlrm, _table_configs
    from torchrec import EmbeddingBagCollection

    torch.manual_seed(0)
    keys = [f"s{i}" for i in range(spec.num_features)]
    model = _dlrm(spec, EmbeddingBagCollection(tables=_table_configs(spec, keys), device=torch.device("meta")))
    dense, pooled, labels = _inputs(spec)
    sparse = pooled.view(spec.batch_size, spec.num_features, spec.dim)
    arches = [model.dense_arch, model.inter_arch, model.over_arch]
    opt = torch.optim.Adagrad([p for m in arches for p in m.parameters()], lr=DENSE_LR, eps=EPS, fused=True)

    def step() -> None:
        with maybe_bf16(bf16):
            logits = model.over_arch(model.inter_arch(dense_features=model.dense_arch(dense), sparse_features=sparse))
        loss = F.binary_cross_entropy_with_logits(logits.squeeze(-1).float(), labels)
        opt.zero_grad(set_to_none=True)
        pooled.grad = None
        loss.backward()
        opt.step()

    return step


def whole_step(system_name: str, spec: ModelSpec, bf16: bool, num_batches: int) -> Callable[[], None]:
    """One training step of an ``e2e.py`` system on the dcnv2 tables and synthetic batches."""
    batches = make_batches(spec, 0, 1, num_batches)
    if system_name == "torchrec":
        from _e2e_torchrec import TorchRecSystem

        system = TorchRecSystem(spec, bf16=bf16)
    elif system_name == "plain":
        system = PlainSystem(spec, bf16=bf16)
    else:
        system = RecscaleSystem(spec, mlp_precision="bf16" if bf16 else "fp32")
    cursor = [0]

    def step() -> None:
        system.run(batches, cursor[0], 1)
        cursor[0] += 1

    return step


def measure(steps: dict[str, Callable[[], None]], repeats: int, per_round: int,
            warmup: int) -> dict[str, tuple[float, float]]:
    """Best (wall, CPU) seconds per step of each system over ``repeats`` alternating rounds."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    best = {k: (float("inf"), float("inf")) for k in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                fn()
            w, c = (time.perf_counter() - w0) / per_round, (time.process_time() - c0) / per_round
            best[name] = (min(best[name][0], w), min(best[name][1], c))
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (e2e.py's one-process setup: 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per system (best taken)")
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled by the whole steps")
    p.add_argument("--batch-size", type=int, default=None, help="default 2048 (--quick 256)")
    p.add_argument("--bf16", action="store_true", help="bf16 MLPs (recscale) against torch.autocast (the others)")
    p.add_argument("--no-whole-steps", action="store_true", help="dense parts only (no tables built)")
    p.add_argument("--quick", action="store_true", help="tiny tables and batch, 2 rounds of 1 step")
    args = p.parse_args(argv)
    for name in ("threads", "repeats", "steps", "num_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from e2e import TUNED_ENV, worker_env

    if any(os.environ.get(k) != v for k, v in TUNED_ENV.items()):  # the allocator settings act at exec
        env = worker_env(args.threads, True)
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], env)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.num_batches = 2, 1, 1, 2
    torch.set_num_threads(args.threads)
    spec = make_spec("dcnv2", args.quick, args.batch_size)
    trec = torchrec_available()
    steps: dict[str, Callable[[], None]] = {
        "recscale dense": recscale_dense(spec, args.bf16), "plain dense": plain_dense(spec, args.bf16)}
    if not trec:
        steps["torchrec dense"] = torchrec_dense(spec, args.bf16)
    if not args.no_whole_steps:
        if not trec:
            steps["torchrec step"] = whole_step("torchrec", spec, args.bf16, args.num_batches)
        steps["recscale step"] = whole_step("recscale", spec, args.bf16, args.num_batches)
        steps["plain step"] = whole_step("plain", spec, args.bf16, args.num_batches)
    t0 = time.monotonic()
    best = measure(steps, args.repeats, args.steps, args.warmup)
    prec = "bf16 (recscale bf16 MLPs; others under autocast)" if args.bf16 else "fp32"
    print(f"dcnv2 dense part, {prec}: batch {spec.batch_size}, {args.threads} threads, best of {args.repeats} rounds "
          f"of {args.steps} steps, systems alternating ({time.monotonic() - t0:.0f} s)")
    print(f"{'':16s} {'wall ms/step':>12s} {'samples/s':>10s} {'CPU ms/step':>12s}")
    for name, (w, c) in best.items():
        print(f"{name:16s} {w * 1e3:12.1f} {spec.batch_size / w:10,.0f} {c * 1e3:12.1f}")
    if trec:
        print(f"torchrec rows skipped: TorchRec not importable ({trec})")
    if "torchrec step" in best:
        ours = best["recscale dense"][0]
        fastest = min(best[k][0] for k in best if k.endswith("dense"))
        ts = best["torchrec step"][0]
        print(f"torchrec's dense part: {best['torchrec dense'][0] / ts:.0%} of its whole step (wall)")
        print(f"Amdahl bound vs torchrec (wall): torchrec step / recscale dense = {ts / ours:.2f}x; "
              f"/ fastest dense part = {ts / fastest:.2f}x; recscale step now: {ts / best['recscale step'][0]:.2f}x")
        cpu = best["torchrec step"][1] / best["recscale dense"][1]
        print(f"the same bound in CPU time (less sensitive to a busy machine): {cpu:.2f}x")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
