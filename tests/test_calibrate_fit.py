"""The calibration's compute fit on probe times made by the cost model's own formula from known
constants: the byte term must be recovered, not traded for the per-item terms, also with the
few percent of noise a real machine's medians keep."""

from __future__ import annotations

import numpy as np
import pytest

from recscale.planner.calibrate import FIT_TERMS, Probe, compute_cases, fit, probe_terms

# Per-thread constants of the order a two-rank calibration measures on a small CPU (one thread
# per rank: the per-item work weighs far more than the bytes).
TRUTH = {"bytes": 1 / 40e9, "id_s": 15e-9, "row_s": 150e-9, "cold_byte_s": 0.5e-9, "bag_s": 30e-9,
         "kernel_overhead_s": 0.0, "group_s": 100e-6, "route_id_s": 30e-9, "route_table_s": 150e-6,
         "column_stat_id_s": 30e-9, "column_stat_shard_s": 500e-6, "feature_s": 0.0, "dist_id_s": 10e-9,
         "dist_value_s": 1.6e-9, "step_overhead_s": 5e-4}


def _design(quick: bool, ranks: int) -> list[tuple[str, dict[str, float]]]:
    """Every stage-1 probe's terms as a calibration for ``ranks`` local ranks counts them (the
    ranks of a 32 MiB-cache host share it)."""
    batches = (512, 2048) if quick else (1024, 4096)
    return [(name, probe_terms(plan, tables, gb[0], 1.0, (32 << 20) / ranks))
            for name, plan, tables, gb in compute_cases(batches, quick)]


@pytest.fixture(scope="module", params=[(False, 2), (True, 2), (False, 1)],
                ids=["full-2-ranks", "quick-2-ranks", "full-1-rank"])
def design(request):
    return _design(*request.param)


def test_exact_times_fit_back_to_the_constants_that_made_them(design):
    probes = [Probe(name, terms, sum(TRUTH[k] * terms[k] for k in FIT_TERMS)) for name, terms in design]
    coef, backward_factor, err = fit({1.0: probes})
    assert backward_factor == 1.0 and err < 1e-6
    assert coef["bytes"] == pytest.approx(TRUTH["bytes"], rel=1e-3)
    for k in ("id_s", "row_s", "bag_s", "cold_byte_s", "group_s"):
        assert coef[k] == pytest.approx(TRUTH[k], rel=1e-3), k


@pytest.mark.parametrize("seed", range(6))
def test_the_byte_term_survives_noisy_times(design, seed):
    # 10% log-normal noise per probe: what a shared machine's medians keep. The byte term must
    # stay within a quarter of the truth, not drop to zero (a gather bandwidth of 1e15 B/s) nor
    # double, as it did when only the large, all-cold tables moved many bytes per id.
    rng = np.random.default_rng(seed)
    probes = [Probe(name, terms, sum(TRUTH[k] * terms[k] for k in FIT_TERMS) * float(np.exp(rng.normal(0.0, 0.1))))
              for name, terms in design]
    coef, _, _ = fit({1.0: probes})
    assert 0.75 < coef["bytes"] / TRUTH["bytes"] < 1.33, coef["bytes"] / TRUTH["bytes"]
