"""A calibration's raw measurements, kept beside its hardware file: they round-trip, fit again
to the same constants without measuring, and several of one kind pool into one fit."""

from __future__ import annotations

import json

import pytest

from recscale.planner.calibrate import FIT_TERMS, Measurements, compute_cases, fit_hardware, probe_terms
from recscale.planner.calibration_record import (load_measurements, measurements_path, pool_measurements,
                                                 save_measurements)
from recscale.planner.hardware import LOCAL_CPU, Hardware

TRUTH = {"bytes": 1 / 20e9, "id_s": 10e-9, "row_s": 50e-9, "cold_byte_s": 0.3e-9, "bag_s": 3e-9,
         "kernel_overhead_s": 5e-6, "group_s": 300e-6, "route_id_s": 20e-9, "route_table_s": 60e-6,
         "column_stat_id_s": 40e-9, "column_stat_shard_s": 400e-6, "feature_s": 2e-6, "dist_id_s": 4e-9,
         "dist_value_s": 1e-9, "step_overhead_s": 5e-4}


def _recording(factors: tuple[float, ...], jitter: float = 0.0) -> Measurements:
    """One rank's probes timed by the cost model's formula, each round scaled by a factor (a
    machine's drift from one round to the next)."""
    m = Measurements(world_size=1, quick=True, cache_bytes=32 << 20, physical_memory_bytes=8e9, compute={},
                     all_to_all={"intra_host_bw": 1e12, "latency_s": 0.0}, sync_jitter=jitter)
    for name, plan, tables, gb in compute_cases(m.batches, quick=True):
        t = sum(TRUTH[k] * v for k, v in probe_terms(plan, tables, gb[0], 1.0, m.cache_bytes).items() if k in TRUTH)
        m.compute[name] = [t * f for f in factors]
    return m


def test_a_saved_recording_loads_equal_and_fits_to_the_same_machine(tmp_path):
    m = _recording((0.97, 1.0, 1.04))
    m.collection_tcp_cpu = {"probe": [1e-3, 2e-3]}
    path = measurements_path(tmp_path / "topology-local-1.json")
    assert path.name == "topology-local-1.measurements.json"
    save_measurements(m, path)
    again = load_measurements(path)
    assert again == m
    assert fit_hardware(again) == fit_hardware(m)


def test_pooled_recordings_take_every_round_and_the_median_figures():
    slow, fast = _recording((1.3, 1.4), jitter=0.6), _recording((0.8, 0.9, 1.0), jitter=0.2)
    third = _recording((1.0, 1.0), jitter=0.3)
    pooled = pool_measurements([slow, fast, third])
    name = next(iter(slow.compute))
    assert pooled.compute[name] == slow.compute[name] + fast.compute[name] + third.compute[name]
    assert pooled.sync_jitter == 0.3  # the median of 0.6, 0.2, 0.3
    # each probe's median over the seven rounds is the formula's own time (factor 1.0): the fit
    # recovers the machine that neither drifted recording alone gives
    hw = fit_hardware(pooled)
    fitted = {"bytes": 1 / hw.memory_bw, **{k: getattr(hw, k) for k in FIT_TERMS if k != "bytes"}}
    for n, plan, tables, gb in compute_cases(pooled.batches, quick=True):
        terms = probe_terms(plan, tables, gb[0], 1.0, hw.cache_bytes)
        expected = sum(TRUTH[k] * v for k, v in terms.items() if k in TRUTH)
        assert sum(fitted[k] * terms[k] for k in FIT_TERMS) == pytest.approx(expected, rel=1e-3), n
    assert fit_hardware(pool_measurements([fast, fast])) == fit_hardware(fast)  # duplicated rounds: same medians


def test_recordings_of_other_kinds_do_not_pool_and_other_files_are_refused(tmp_path):
    two = _recording((1.0,))
    two.world_size = 2
    with pytest.raises(ValueError, match="recording 2 is of 2 rank"):
        pool_measurements([_recording((1.0,)), two])
    hardware = tmp_path / "topology-local-1.json"
    LOCAL_CPU.save(hardware)
    with pytest.raises(ValueError, match="not a calibration recording"):
        load_measurements(hardware)
    bad = tmp_path / "bad.measurements.json"
    bad.write_text(json.dumps({"recscale_calibration_measurements": 1, "world_size": 1, "speed": 3}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['speed'\]"):
        load_measurements(bad)


def test_calibrate_refit_fits_recordings_without_measuring(tmp_path, monkeypatch, capsys):
    from recscale import cli
    from recscale.planner import calibrate
    def no_measuring(*_a, **_k):
        raise AssertionError("--refit must not measure")

    monkeypatch.setattr(calibrate, "measure", no_measuring)
    a, b = tmp_path / "a.measurements.json", tmp_path / "b.measurements.json"
    save_measurements(_recording((1.3, 1.4)), a)
    save_measurements(_recording((0.9, 1.0, 1.1)), b)
    out = tmp_path / "refit.json"
    assert cli.main(["calibrate", "--refit", str(a), str(b), "--out", str(out)]) == 0
    assert "fitting 2 recording(s) of 1 rank(s), no measuring" in capsys.readouterr().out
    pooled = pool_measurements([load_measurements(a), load_measurements(b)])
    assert Hardware.load(out) == fit_hardware(pooled)
    assert load_measurements(measurements_path(out)) == pooled  # the pooled recording is kept beside
    assert cli.main(["calibrate", "--refit", str(a), "--ranks", "2", "--out", str(out)]) != 0
    assert "--ranks 2: the recordings are of 1 rank(s)" in capsys.readouterr().err
    assert cli.main(["calibrate", "--refit", str(out), "--out", str(tmp_path / "x.json")]) != 0
    assert "--refit: " in (err := capsys.readouterr().err) and "not a calibration recording" in err
