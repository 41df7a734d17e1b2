"""Small helpers shared by the benchmarks: timing, skewed ids, table printing, JSON output.

Kept free of recscale imports so any benchmark (or a plain-PyTorch baseline) can use it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale.atomic import write_text_atomic

# --------------------------------------------------------------------------- environment


def set_threads(threads: int | None) -> int:
    """Apply ``--threads`` (when given) and return the number of intra-op threads in use."""
    if threads is not None:
        if threads <= 0:
            raise SystemExit(f"--threads must be > 0, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# --------------------------------------------------------------------------- training runs


def add_train_config_args(ap: argparse.ArgumentParser, default_config: Path) -> None:
    """``--config`` (a training TOML), ``--set`` overrides of it, ``--threads`` and ``--json``:
    what the benchmarks that run ``recscale train`` in-process take."""
    ap.add_argument("--config", default=str(default_config))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. train.seed=1 (repeatable)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")


def apply_train_config_args(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    if not Path(args.config).is_file():
        raise SystemExit(f"config '{args.config}' not found")


def train_quietly(config: str, overrides: list[str]) -> dict[str, Any]:
    """``recscale train`` on ``config`` with ``overrides``, no progress bar or log; its summary."""
    from recscale.train.config import load_config
    from recscale.train.loop import train

    return train(load_config(config, ["train.progress=false"] + overrides), log=lambda _: None)


# --------------------------------------------------------------------------- environment


def environment() -> dict[str, Any]:
    """What the numbers were measured on (goes into the JSON output)."""
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------- ids


def _coprime_multiplier(n: int, start: int) -> int:
    a = start % n or 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


def zipf_ids(num_rows: int, size: int, rng: np.random.Generator, alpha: float = 1.05, salt: int = 0) -> np.ndarray:
    """``size`` int64 ids in ``[0, num_rows)`` with a Zipf-like (power-law) popularity.

    Ranks follow a truncated continuous power law ``p(r) ~ r^-alpha`` over ``[1, num_rows]``
    (inverse-CDF sampling, so it never falls outside the table), then are scattered over the
    table by the bijection ``id = (a * rank + salt) mod num_rows`` with ``a`` coprime to
    ``num_rows``: the hot rows are spread out, as hashed ids are in real data, not packed at
    the start of the table.
    """
    if num_rows <= 0:
        raise ValueError(f"num_rows must be > 0, got {num_rows}")
    u = rng.random(size)
    if num_rows == 1:
        return np.zeros(size, dtype=np.int64)
    if abs(alpha - 1.0) < 1e-9:
        ranks = np.exp(u * math.log(num_rows))
    else:
        e = 1.0 - alpha
        ranks = ((num_rows**e - 1.0) * u + 1.0) ** (1.0 / e)
    ranks = np.minimum(np.floor(ranks).astype(np.int64) - 1, num_rows - 1)  # 0-based
    a = _coprime_multiplier(num_rows, 2_654_435_761 + 97 * salt)
    return (ranks * a + salt * 40_503) % num_rows


# --------------------------------------------------------------------------- timing


def zipf_batches(tables: int, rows: int, batch: int, alpha: float, count: int, seed: int = 1234) -> list:
    """``count`` batches of one Zipf id per sample from each of ``tables`` tables of ``rows`` rows
    (features ``f0``, ``f1``, ...), 13 dense features and labels with a 25% positive rate."""
    from recscale.data import Batch
    from recscale.sparse import JaggedBatch

    rng = np.random.default_rng(seed)
    names = [f"f{i}" for i in range(tables)]
    out = []
    for _ in range(count):
        ids = np.stack([zipf_ids(rows, batch, rng, alpha, salt=t) for t in range(tables)], 1)
        dense = torch.from_numpy(rng.standard_normal((batch, 13), dtype=np.float32))
        labels = torch.from_numpy((rng.random(batch) < 0.25).astype(np.float32))
        out.append(Batch(dense, JaggedBatch.from_dense_ids(names, torch.from_numpy(ids)), labels))
    return out


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-iteration times, in milliseconds."""
    ms = [s * 1e3 for s in samples_s]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def time_phases(
    forward: Callable[[int], Any],
    backward: Callable[[int, Any], None],
    iters: int,
    warmup: int,
    sync: Callable[[], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Run ``warmup`` then ``iters`` timed iterations of ``out = forward(i); backward(i, out)``.

    Returns ``{"forward": ..., "backward_update": ..., "total": ...}``, each a
    :func:`summarize` dict (ms). ``sync`` (e.g. ``torch.cuda.synchronize``) runs before every
    clock read so asynchronous devices are timed correctly.
    """
    sync = sync or (lambda: None)
    for i in range(warmup):
        backward(i, forward(i))
    sync()
    fwd, bwd, tot = [], [], []
    for i in range(iters):
        sync()
        t0 = time.perf_counter()
        out = forward(warmup + i)
        sync()
        t1 = time.perf_counter()
        backward(warmup + i, out)
        sync()
        t2 = time.perf_counter()
        del out
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        tot.append(t2 - t0)
    return {"forward": summarize(fwd), "backward_update": summarize(bwd), "total": summarize(tot)}


def fmt_ms(s: dict[str, float]) -> str:
    """``median [min-max]`` of a :func:`summarize` dict."""
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


# --------------------------------------------------------------------------- output


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right_align_from: int = 1) -> str:
    """A plain aligned text table (no dependencies); columns from ``right_align_from`` on are
    right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        parts = [c.rjust(w) if i >= right_align_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write ``payload`` as JSON atomically (temporary file, fsync, rename)."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False) + "\n")
