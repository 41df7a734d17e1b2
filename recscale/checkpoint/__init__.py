"""Check-N-Run checkpoints: sharded, asynchronous, differential and quantized, with exact resume
and resharding onto a different world size or plan.

Layers inside this package (imports point down): ``manager`` (when and what to write, retention)
-> ``writer`` (snapshot, background quantize + write, commit) and ``restore`` (chains, resharding)
-> ``lineage`` (run folders, latest, stale branches), ``policy``, ``tracker``, ``quantize``, ``shards``
-> ``manifest`` (format) -> ``storage``.
"""

from recscale.checkpoint.manifest import FORMAT_VERSION, CheckpointError, Manifest
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.storage import LocalStorage, Storage

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointSettings", "LocalStorage", "Manifest", "Storage"]
