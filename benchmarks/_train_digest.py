"""Run ``recscale train`` as the CLI does (one process, or one rank of a torchrun job) and write a
digest of this rank's final training state: what the kill campaign and the elastic-restart test
compare bit for bit against an uninterrupted run.

    torchrun --nproc_per_node=2 benchmarks/_train_digest.py DIGEST_DIR train --set ...

Writes ``DIGEST_DIR/rank<R>.json`` ({"rank", "attempt", "digest", "steps"}) when training
succeeds; the exit status is the CLI's. The digest covers this rank's model state (its embedding
shards with their optimizer state, the dense parameters) and the dense optimizer's state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def _update(h: "hashlib._Hash", key: str, value: Any) -> None:
    h.update(key.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _update(h, f"{key}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _update(h, f"{key}[{i}]", v)
    else:
        h.update(repr(value).encode())


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    _update(h, "model", model.state_dict())
    _update(h, "optimizer", optimizer.state_dict()["state"])
    return h.hexdigest()


def main(argv: list[str]) -> int:
    out, cli_args = Path(argv[0]), argv[1:]
    import recscale.train.loop as loop
    from recscale.cli import main as cli_main

    captured: dict[str, Any] = {}
    build_model, build_opt, run_train = loop.build_model, loop.build_dense_optimizer, loop._train

    def model_hook(*a: Any, **k: Any) -> Any:
        captured["model"] = build_model(*a, **k)
        return captured["model"]

    def opt_hook(*a: Any, **k: Any) -> Any:
        captured["opt"] = build_opt(*a, **k)
        return captured["opt"]

    def train_hook(*a: Any, **k: Any) -> dict[str, Any]:
        summary = run_train(*a, **k)
        captured["steps"] = summary["steps"]
        return summary

    loop.build_model, loop.build_dense_optimizer, loop._train = model_hook, opt_hook, train_hook
    rc = cli_main(cli_args)
    if rc == 0 and "model" in captured:
        rank = int(os.environ.get("RANK", "0"))
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": rank, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "digest": state_digest(captured["model"], captured["opt"]), "steps": captured["steps"],
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
