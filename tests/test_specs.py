"""Spec loading and validation, catalog selection, and the spec linter's messages."""

from pathlib import Path

import pytest

from flash_catalog import Catalog, SpecError, load_spec
from flash_catalog.catalog.catalog import specs_dir

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


def test_every_problem_in_a_file_is_reported_at_once(tmp_path):
    text = (GOOD.replace('precision = "fp8"', 'precision = "fp9"').replace('dtypes = ["bfloat16"]', 'dtypes = []')
            .replace("min_cosine = 0.999", "min_cosine = 1.5").replace("[envelope]", "[envelope]\ncolour = 1"))
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    problems = err.value.problems
    assert [p.field for p in problems] == ["precision", "envelope.colour", "envelope.dtypes", "accuracy.min_cosine"]
    assert all(p.path == path for p in problems)
    assert str(err.value).splitlines() == [str(p) for p in problems]
    assert str(problems[2]) == (f"{path}: field 'envelope.dtypes' is []; allowed: a non-empty list of float16, "
                                f"bfloat16, float32")


def test_a_missing_table_is_one_problem_not_one_per_field(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, GOOD.split("[envelope]")[0] + "[accuracy]" + GOOD.split("[accuracy]")[1]))
    assert [p.message for p in err.value.problems] == ["field 'envelope' is missing; allowed: a table"]


@pytest.mark.parametrize("old,new,message", [
    ("masks = [\"none\"]", "masks = [\"none\"]\nmin_seq = 512\nmax_seq = 128",
     "field 'envelope.min_seq' is 512; allowed: at most envelope.max_seq (128)"),
    ("head_dims = [64, 128]", "head_dims = [64, 128]\nmax_head_dim = 96",
     "field 'envelope.head_dims' is 128; allowed: head dims <= envelope.max_head_dim (96)"),
    ('devices = ["cuda"]', 'devices = ["cpu"]',
     "field 'envelope.min_capability' is '8.9'; allowed: unset when envelope.devices has no 'cuda'"),
    ('min_capability = "8.9"', 'emulation = true',
     "field 'envelope.emulation' is True; allowed: false unless envelope.min_capability is set"),
    ('min_capability = "8.9"', 'min_capability = "8.0"',
     "field 'envelope.min_capability' is '8.0'; allowed: at least '8.9' for precision fp8 (its tensor cores), "
     "or emulation = true"),
    ('min_capability = "8.9"\ndtypes = ["bfloat16"]', 'min_capability = "7.5"\ndtypes = ["float16", "bfloat16"]',
     "field 'envelope.dtypes' is 'bfloat16'; allowed: dtypes without bfloat16 below CUDA sm_80"),
    ('masks = ["none"]', 'masks = ["none", "causal", "none"]', "field 'envelope.masks' is 'none'; allowed: each "
                                                               "value once"),
])
def test_fields_that_contradict_each_other(tmp_path, old, new, message):
    text = GOOD.replace(old, new)
    if "7.5" in new:
        text = text.replace('precision = "fp8"', 'precision = "native"')
    assert text != GOOD
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, text))
    assert [p.message for p in err.value.problems if p.message.startswith(message)], str(err.value)


def test_emulation_lifts_the_precision_floor(tmp_path):
    text = GOOD.replace('min_capability = "8.9"', 'min_capability = "10.0"\nemulation = true').replace(
        'precision = "fp8"', 'precision = "fp4"')
    assert load_spec(write(tmp_path, text)).envelope.emulation


def test_attention_fields_in_a_feed_forward_spec_are_refused(tmp_path):
    text = GOOD.replace('family = "attention_core"', 'family = "vision_ffn"').replace(
        "flash_catalog.forms.sdpa_dense:SdpaDense", "flash_catalog.forms.fp8_rowwise:Fp8RowwiseFfn")
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, text))
    assert [p.field for p in err.value.problems] == ["envelope.head_dims", "envelope.masks"]
    assert "(head_dims, max_head_dim, min_seq, max_seq, masks, causal, gqa, returns_lse describe attention calls: " \
           "attention_core specs only)" in str(err.value)


def test_a_profile_given_as_a_spec_says_so(tmp_path):
    with pytest.raises(SpecError, match="this is a profile .* profiles live in a profiles/ folder"):
        load_spec(write(tmp_path, 'name = "p"\nffn_forms = ["fp8_rowwise"]\n'))


def test_a_catalog_extends_the_shipped_one_and_a_clash_names_both_files(tmp_path):
    write(tmp_path, GOOD, "toy.toml")
    shipped = Catalog.shipped()
    extended = Catalog.load([tmp_path], extend=True)
    assert [s.name for s in extended.specs] == [s.name for s in shipped.specs] + ["toy_form"]
    assert shipped.extend([tmp_path]) == extended
    clash = write(tmp_path, GOOD.replace('name = "toy_form"', 'name = "sdpa_dense"'), "clash.toml")
    with pytest.raises(SpecError) as err:
        shipped.extend([clash])
    assert str(err.value) == (f"{clash}: field 'name' is 'sdpa_dense'; allowed: a name not already used (also "
                              f"declared in {specs_dir() / 'attention_core' / 'sdpa_dense.toml'})")


def test_a_catalog_load_reports_the_problems_of_every_file(tmp_path):
    write(tmp_path, GOOD.replace('precision = "fp8"', 'precision = "fp9"'), "a.toml")
    write(tmp_path, GOOD.replace('name = "toy_form"', 'name = "Toy"'), "b.toml")
    with pytest.raises(SpecError) as err:
        Catalog.load([tmp_path])
    assert [(p.path.name, p.field) for p in err.value.problems] == [("a.toml", "precision"), ("b.toml", "name")]


def test_build_form_refuses_a_class_of_the_other_family(tmp_path):
    from flash_catalog.catalog.catalog import build_form

    spec = load_spec(write(tmp_path, GOOD.replace("flash_catalog.forms.sdpa_dense:SdpaDense",
                                                  "flash_catalog.forms.fp8_rowwise:Fp8RowwiseFfn")))
    with pytest.raises(SpecError, match=r"field 'implementation' is 'flash_catalog.forms.fp8_rowwise:Fp8RowwiseFfn', "
                                        r"a vision_ffn form; allowed: a subclass of "
                                        r"flash_catalog.forms.base.AttentionForm \(family attention_core\)"):
        build_form(spec)


def test_an_empty_hub_table_names_its_missing_fields(tmp_path):
    text = GOOD.replace('implementation = "flash_catalog.forms.sdpa_dense:SdpaDense"\n', "") + "[hub]\n"
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, text))
    assert [p.field for p in err.value.problems] == ["hub.repo", "hub.function", "hub.version"]
