"""A calibration's raw measurements on disk, beside the constants fitted to them.

A shared machine's speed drifts: two calibrations an hour apart can disagree on a collective's
cost by several times. Keeping what was measured lets a fit be re-run (with a newer fit, or
on the rounds of several calibrations pooled, each probe's median over all of them) without
measuring again."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, fields
from pathlib import Path

from recscale.atomic import write_text_atomic
from recscale.planner.calibrate import Measurements

SUFFIX = ".measurements.json"
_PROBE_FIELDS = ("compute", "collection", "collection_tcp", "collection_tcp_cpu")


def measurements_path(hardware_path: str | os.PathLike[str]) -> Path:
    """Where the measurements of the hardware file ``hardware_path`` are kept:
    ``topology-local-2.json`` -> ``topology-local-2.measurements.json``."""
    p = Path(hardware_path)
    return p.with_name(p.name[: -len(".json")] + SUFFIX if p.name.endswith(".json") else p.name + SUFFIX)


def save_measurements(m: Measurements, path: str | os.PathLike[str]) -> None:
    write_text_atomic(path, json.dumps({"recscale_calibration_measurements": 1, **asdict(m)}, indent=1) + "\n")


def load_measurements(path: str | os.PathLike[str]) -> Measurements:
    """A recording written by ``save_measurements``; a clear error for anything else."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: not a readable calibration recording ({e})") from None
    if not isinstance(d, dict) or d.pop("recscale_calibration_measurements", None) != 1:
        raise ValueError(f"{p}: not a calibration recording (`recscale calibrate` writes one beside its hardware "
                         f"file, named *{SUFFIX})")
    known = {f.name for f in fields(Measurements)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{p}: unknown field(s) {unknown}; expected some of {sorted(known)}")
    try:
        m = Measurements(**d)
    except TypeError as e:
        raise ValueError(f"{p}: {e}") from None
    for name in _PROBE_FIELDS:
        probes = getattr(m, name)
        if not isinstance(probes, dict) or not all(isinstance(v, list) for v in probes.values()):
            raise ValueError(f"{p}: '{name}' must map each probe's name to its list of seconds per round")
    return m


def pool_measurements(recordings: list[Measurements]) -> Measurements:
    """One set of measurements from several calibrations of the same kind: every probe's
    rounds from all of them (the fit takes each probe's median), the median of the single
    figures (contention, jitter, the isolated all-to-all)."""
    if not recordings:
        raise ValueError("no calibration recordings to pool")
    first = recordings[0]
    for i, m in enumerate(recordings[1:], start=2):
        if (m.world_size, m.quick) != (first.world_size, first.quick):
            raise ValueError(f"recording {i} is of {m.world_size} rank(s){' (quick)' if m.quick else ''}, "
                             f"recording 1 of {first.world_size}{' (quick)' if first.quick else ''}: "
                             "pool calibrations of one kind only")
    if len(recordings) == 1:
        return first

    def rounds(name: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for m in recordings:
            for probe, times in getattr(m, name).items():
                out.setdefault(probe, []).extend(times)
        return out

    keys = set.intersection(*(set(m.all_to_all) for m in recordings))
    return Measurements(
        world_size=first.world_size, quick=first.quick, cache_bytes=first.cache_bytes,
        physical_memory_bytes=first.physical_memory_bytes, compute=rounds("compute"),
        all_to_all={k: statistics.median(m.all_to_all[k] for m in recordings) for k in sorted(keys)},
        contention=statistics.median(m.contention for m in recordings),
        sync_jitter=statistics.median(m.sync_jitter for m in recordings),
        collection=rounds("collection"), collection_tcp=rounds("collection_tcp"),
        collection_tcp_cpu=rounds("collection_tcp_cpu"))
