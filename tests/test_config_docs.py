"""docs/configuration.md is generated from the config dataclasses and must match them."""

from dataclasses import dataclass

from recscale.train import config_docs


def test_configuration_doc_is_up_to_date():
    text = config_docs.render()
    on_disk = config_docs.DOC_PATH.read_text() if config_docs.DOC_PATH.is_file() else ""
    assert on_disk == text, "docs/configuration.md is stale: run python -m recscale.train.config_docs"
    assert config_docs.main(["--check"]) == 0


def test_every_key_is_documented_with_its_default():
    text = config_docs.render()
    assert "| `batch_size` | int | `256` |" in text
    assert "| `tables.NAME.shards` | int | `0` |" in text
    assert "| `policy` | `\"full\"` \\| `\"one_shot\"`" in text


@dataclass
class _Example:
    # Rows per chunk:
    # the unit of writing.
    chunk_rows: int = 8
    plain: bool = True
    inline: str = "x"  # said on its line


def test_field_comments_come_from_the_source():
    assert config_docs.field_comments(_Example) == {
        "chunk_rows": "Rows per chunk: the unit of writing.",
        "inline": "said on its line",
    }


def test_check_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render().replace("`256`", "`512`"))
    assert config_docs.main(["--check", "--out", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
