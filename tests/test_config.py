from pathlib import Path

import numpy as np
import pytest
import torch

from recscale.cli import main
from recscale.train.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.train.batch_size == 256


def test_shipped_configs_parse(monkeypatch):
    monkeypatch.chdir(ROOT)
    load_config(ROOT / "configs" / "synthetic.toml")
    load_config(ROOT / "configs" / "checkpoint_accuracy.toml")
    if (ROOT.parent / "shared" / "data" / "criteo").is_dir():
        cfg = load_config(ROOT / "configs" / "criteo_10k.toml")
        assert cfg.model.table_rows == "auto"
        # The sizes the data gives: every id of either file has a row, none more.
        from recscale.train.datasets import build_data

        data = build_data(cfg)
        ids = np.concatenate([np.loadtxt(ROOT.parent / "shared" / "data" / "criteo" / f"criteo_10k_encoded_{s}.csv",
                                         delimiter=",", dtype=np.int64)[:, 14:] for s in ("train", "test")])
        assert list(data.table_rows) == [int(v) + 1 for v in ids.max(axis=0)]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[train]\nbatchsize = 3\n", "unknown config key 'train.batchsize'; did you mean 'batch_size'?"),
        ("[nope]\nx = 1\n", "unknown config key 'nope'"),
        ("[train]\nbatch_size = 'big'\n", "'train.batch_size': expected an integer, got 'big'"),
        ("[train]\nbatch_size = 0\n", "'train.batch_size': expected a value > 0"),
        ("[train]\nprogress = 1\n", "'train.progress': expected true or false"),
        ("[embedding_optimizer]\nname = 'lamb'\n", "'embedding_optimizer.name': expected one of"),
        ("[model]\nbottom_mlp = [64, 8]\n", "'model.bottom_mlp': must end with model.embedding_dim (16)"),
        ("[model]\ntop_mlp = [64, 2]\n", "'model.top_mlp': must end with 1"),
        ("[data]\nsource = 'criteo_tsv'\n", "'data.train_path': required"),
        ("[data]\nsource = 'criteo_tsv'\ntrain_path = 'no/such.tsv'\n", "'data.train_path': file 'no/such.tsv' does not exist"),
        ("[train\n", "is not valid TOML"),
        ("[dense_optimizer]\neps = 0\n", "'dense_optimizer.eps': expected a value > 0"),
        ("[data]\nseed = -2\n", "'data.seed': expected a seed >= 0, or -1 to use train.seed"),
        ("[dense_optimizer]\ninitial_accumulator_value = -1\n", "'dense_optimizer.initial_accumulator_value': expected a value >= 0"),
    ],
)
def test_bad_config_gets_one_clear_error(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_set_overrides_parse_toml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, "[train]\nbatch_size = 8\n"),
        ["train.batch_size=32", "model.top_mlp=[8, 1]", "data.source=synthetic", "train.progress=false"],
    )
    assert cfg.train.batch_size == 32
    assert cfg.model.top_mlp == [8, 1]
    assert cfg.data.source == "synthetic"
    assert cfg.train.progress is False


def test_dense_adagrad_settings_reach_the_optimizer(tmp_path):
    import torch

    from recscale.train.model_factory import build_dense_optimizer

    cfg = load_config(write(tmp_path, "[dense_optimizer]\nname = 'adagrad'\ninitial_accumulator_value = 0.1\neps = 1e-6\n"))
    w = torch.nn.Parameter(torch.zeros(3))
    opt = build_dense_optimizer(cfg, [w])
    w.grad = torch.full((3,), 1e-4)
    opt.step()
    # The first step is lr * g / (sqrt(0.1 + g^2) + 1e-6), not torch's default full step of lr.
    expected = -cfg.dense_optimizer.lr * 1e-4 / ((0.1 + 1e-8) ** 0.5 + 1e-6)
    torch.testing.assert_close(w.detach(), torch.full((3,), expected))
    assert opt.state[w]["sum"][0].item() == pytest.approx(0.1 + 1e-8)


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_dense_optimizer_is_fused_on_cpu_and_matches_torch_unfused(tmp_path, name):
    import torch

    from recscale.train.model_factory import build_dense_optimizer

    cfg = load_config(None, [f"dense_optimizer.name={name}", "dense_optimizer.lr=0.05"])
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(7, 5, generator=gen), torch.randn(5, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = build_dense_optimizer(cfg, ours)
    assert opt.defaults["fused"] is True
    d = cfg.dense_optimizer
    if name == "adagrad":
        ref_opt = torch.optim.Adagrad(ref, lr=d.lr, initial_accumulator_value=d.initial_accumulator_value, eps=d.eps)
    else:
        ref_opt = torch.optim.Adam(ref, lr=d.lr)
    for _ in range(4):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b, start in zip(ours, ref, init):
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, start)


def test_set_with_bad_syntax():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["batch_size=3"])


def test_cli_reports_config_errors_on_one_line_with_exit_2(tmp_path, capsys):
    code = main(["train", "--config", str(write(tmp_path, "[train]\nbatch_sise = 3\n"))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "train.batch_sise" in err


def test_cli_missing_config_file(capsys):
    assert main(["train", "--config", "does/not/exist.toml"]) == 2
    assert "does/not/exist.toml" in capsys.readouterr().err


def test_num_workers_is_auto_or_a_count() -> None:
    assert load_config(None).data.num_workers == "auto"
    assert load_config(None, ["data.num_workers=2"]).data.num_workers == 2
    for bad, what in (("many", "expected an integer or 'auto'"), ("-1", "expected a value >= 0")):
        with pytest.raises(ConfigError, match=rf"data\.num_workers'.*{what}"):
            load_config(None, [f"data.num_workers={bad}"])


def test_data_seed_fixes_the_synthetic_data_while_the_training_seed_varies() -> None:
    from recscale.train.datasets import build_data

    def first_batch(sets: list[str]):
        b = build_data(load_config(None, ["data.num_samples=2048", "data.shuffle=false"] + sets)).train[0]
        return b.labels, b.sparse.values

    fixed = [first_batch(["data.seed=7", f"train.seed={s}"]) for s in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*fixed))
    free = [first_batch([f"train.seed={s}"]) for s in (0, 1)]
    assert not torch.equal(free[0][1], free[1][1])
