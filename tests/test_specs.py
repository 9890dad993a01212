"""Spec loading and validation, catalog selection, and the spec linter's messages."""

from pathlib import Path

import pytest

from flash_catalog import Catalog, SpecError, load_spec
from flash_catalog.catalog import specs_dir

GOOD = """
name = "toy_form"
family = "attention_core"
implementation = "flash_catalog.forms.sdpa_dense:SdpaDense"
precision = "fp8"
[envelope]
devices = ["cuda"]
min_capability = "8.9"
dtypes = ["bfloat16"]
head_dims = [64, 128]
masks = ["none"]
requires = ["torch>=2.5"]
[accuracy]
min_cosine = 0.999
max_rel_err = 0.1
[latency]
per_shape = true
min_speedup = 1.1
"""


def write(tmp_path: Path, text: str, name: str = "toy.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_catalog_loads_and_orders_precision_first():
    catalog = Catalog.load()
    names = [s.name for s in catalog.family("attention_core")]
    assert "sdpa_dense" in names
    ranks = [s.precision_rank for s in catalog.family("attention_core")]
    assert ranks == sorted(ranks)
    assert specs_dir().is_dir()


def test_good_spec_fields(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.name == "toy_form" and spec.precision == "fp8"
    assert spec.envelope.min_capability == (8, 9)
    assert spec.envelope.head_dims == (64, 128)
    assert spec.latency.min_speedup == 1.1 and spec.accuracy.min_cosine == 0.999


@pytest.mark.parametrize("old,new,field,value", [
    ('dtypes = ["bfloat16"]', 'dtypes = ["bfloat16", "float8"]', "envelope.dtypes", "'float8'"),
    ('precision = "fp8"', 'precision = "fp9"', "precision", "'fp9'"),
    ('family = "attention_core"', 'family = "attention"', "family", "'attention'"),
    ('min_capability = "8.9"', 'min_capability = 8.9', "envelope.min_capability", "8.9"),
    ('min_cosine = 0.999', 'min_cosine = 1.5', "accuracy.min_cosine", "1.5"),
    ('requires = ["torch>=2.5"]', 'requires = ["torch>>2.5"]', "envelope.requires", "'torch>>2.5'"),
    ('masks = ["none"]', 'masks = ["sparse"]', "envelope.masks", "'sparse'"),
    ('implementation = "flash_catalog.forms.sdpa_dense:SdpaDense"', 'implementation = "sdpa"',
     "implementation", "'sdpa'"),
])
def test_bad_spec_names_file_field_value_and_allowed(tmp_path, old, new, field, value):
    path = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert str(path) in message
    assert f"field '{field}'" in message
    assert value in message
    assert "allowed:" in message


def test_missing_and_unknown_fields(tmp_path):
    with pytest.raises(SpecError, match=r"field 'accuracy' is missing; allowed: a table"):
        load_spec(write(tmp_path, GOOD.split("[accuracy]")[0]))
    with pytest.raises(SpecError, match=r"unknown field 'envelope.colour'"):
        load_spec(write(tmp_path, GOOD.replace("[envelope]", "[envelope]\ncolour = 1")))
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(write(tmp_path, "name = "))


def test_duplicate_names_in_a_catalog(tmp_path):
    write(tmp_path, GOOD, "a.toml")
    write(tmp_path, GOOD, "b.toml")
    with pytest.raises(SpecError, match="also declared in"):
        Catalog.load([tmp_path])


def test_select_order_unknown_and_empty(tmp_path):
    write(tmp_path, GOOD, "a.toml")
    write(tmp_path, Path(specs_dir() / "attention_core" / "sdpa_dense.toml").read_text(), "b.toml")
    catalog = Catalog.load([tmp_path])
    assert [s.name for s in catalog.select("attention_core", None)] == ["sdpa_dense", "toy_form"]
    assert [s.name for s in catalog.select("attention_core", ["toy_form", "sdpa_dense"])] == [
        "toy_form", "sdpa_dense"]
    assert catalog.select("attention_core", []) == []
    with pytest.raises(ValueError, match=r"unknown attention_core form\(s\) 'sage9'; known: sdpa_dense, toy_form"):
        catalog.select("attention_core", ["sage9"])
    with pytest.raises(TypeError, match=r"write \['toy_form'\]"):
        catalog.select("attention_core", "toy_form")
