"""End-to-end training: accuracy on real Criteo data, reproducibility, the CLI contract."""

import json
import re
from pathlib import Path

import pytest
import torch

from recscale.cli import main
from recscale.train.config import load_config
from recscale.train.loop import build_model, train

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "criteo"
TINY_SYNTHETIC = [
    "data.source=synthetic",
    "data.num_samples=4096",
    "data.eval_samples=2048",
    "data.pooling_factors=[1, 3, 2]",
    "data.num_workers=0",
    "model.table_rows=[1000, 5000, 300]",
    "train.batch_size=256",
    "train.progress=false",
]

needs_criteo = pytest.mark.skipif(
    not (SHARED / "criteo_10k_encoded_train.csv").is_file(), reason="../shared/data/criteo is not present"
)


@needs_criteo
def test_criteo_10k_reaches_target_accuracy(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "criteo_10k.toml", ["train.progress=false"])
    s = train(cfg, log=lambda _: None)
    assert s["eval_num_samples"] == 10_000
    assert s["eval_auc"] >= 0.70, s
    assert s["eval_logloss"] <= 0.53, s  # constant click rate gives 0.565


def _weights_after(overrides):
    cfg = load_config(None, overrides)
    summary = train(cfg, log=lambda _: None)
    return summary


def test_two_runs_are_bitwise_identical():
    a = _weights_after(TINY_SYNTHETIC + ["data.num_workers=2"])
    b = _weights_after(TINY_SYNTHETIC)  # also independent of the number of loader workers
    for key in ("eval_auc", "eval_logloss", "train_logloss", "steps"):
        assert a[key] == b[key], key


def test_model_state_identical_after_training(tmp_path):
    """Weights, optimizer state and dense parameters equal bit for bit after two runs."""
    states = []
    for _ in range(2):
        cfg = load_config(None, TINY_SYNTHETIC + ["train.max_steps=5"])
        captured = {}
        import recscale.train.loop as loop

        original = loop.build_model

        def capture(*args, **kwargs):
            m = original(*args, **kwargs)
            captured["model"] = m
            return m

        loop.build_model = capture
        try:
            train(cfg, log=lambda _: None)
        finally:
            loop.build_model = original
        states.append({k: v.clone() for k, v in captured["model"].state_dict().items()})
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_synthetic_learns():
    cfg = load_config(None, TINY_SYNTHETIC + ["data.num_samples=20000", "train.batch_size=128"])
    s = train(cfg, log=lambda _: None)
    assert s["eval_auc"] > 0.6, s


def test_cli_train_writes_summary(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["train", "--summary-json", str(out)]
    for o in TINY_SYNTHETIC + ["train.max_steps=3"]:
        args += ["--set", o]
    assert main(args) == 0
    s = json.loads(out.read_text())
    for key in ("eval_auc", "eval_logloss", "eval_ne", "train_samples_per_sec", "steady_samples_per_sec", "steps", "world_size"):
        assert key in s
    assert s["steps"] == 3 and s["world_size"] == 1
    assert "eval: auc" in capsys.readouterr().out


def test_cli_missing_data_file_is_one_line_error(tmp_path, capsys):
    code = main(["train", "--set", "data.source=criteo_tsv", "--set", "data.train_path=nowhere.tsv"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "nowhere.tsv" in err and "\n" not in err


def test_table_rows_must_match_features(capsys):
    code = main(["train", "--set", "data.source=synthetic", "--set", "model.table_rows=[10, 20]",
                 "--set", "data.pooling_factors=[1, 1, 1]"])
    assert code == 2
    assert "data.pooling_factors" in capsys.readouterr().err


def test_bad_id_in_data_names_feature(tmp_path, monkeypatch, capsys):
    if not (SHARED / "criteo_10k_encoded_train.csv").is_file():
        pytest.skip("../shared/data/criteo is not present")
    monkeypatch.chdir(ROOT)
    code = main(["train", "--config", "configs/criteo_10k.toml", "--set", "model.table_rows=[5]",
                 "--set", "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"categorical feature C\d+: id \d+ is outside its table of 5 rows \(raise model.table_rows", err), err


def test_skipped_bad_rows_are_reported_with_a_held_out_eval(tmp_path, capsys):
    good = "\t".join(["1"] + ["5"] * 13 + ["68fd1e64"] * 26)
    bad = "\t".join(["0"] * 39)
    data = tmp_path / "clicks.tsv"
    data.write_text("\n".join([good] * 40 + [bad] + [good] * 40) + "\n")
    args = ["train", "--set", "data.source=criteo_tsv", "--set", f"data.train_path={str(data)!r}".replace("'", '"'),
            "--set", "data.skip_bad_rows=true", "--set", "data.num_workers=0", "--set", "model.table_rows=[100]",
            "--set", "train.batch_size=16", "--set", "train.progress=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 bad rows skipped, e.g. clicks.tsv:41: expected 40 tab-separated columns" in out


def test_bf16_mlps_on_a_cpu_without_bf16_matmuls_warn(monkeypatch):
    import recscale.native_build as native_build
    import recscale.train.model_factory as model_factory

    for signature, native in (("model name : X\nflags : fpu sse2 avx2 avx512f avx512_bf16\n", True),
                              ("model name : X\nflags : fpu sse2 avx2\n", False),
                              ("x86_64", True)):  # no /proc/cpuinfo: unknown, so no false alarm
        monkeypatch.setattr(native_build, "cpu_signature", lambda s=signature: s)
        assert native_build.cpu_multiplies_bf16() is native
    cfg = load_config(None, TINY_SYNTHETIC + ["model.mlp_precision=bf16"])
    names = tuple(f"c{i}" for i in range(3))
    monkeypatch.setattr(model_factory, "cpu_multiplies_bf16", lambda: False)
    with pytest.warns(UserWarning, match="mlp_precision = 'bf16' on a CPU without"):
        build_model(cfg, names, 13, torch.device("cpu"))
    monkeypatch.setattr(model_factory, "cpu_multiplies_bf16", lambda: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_model(cfg, names, 13, torch.device("cpu"))
