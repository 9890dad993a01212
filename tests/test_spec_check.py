"""The catalog author's tools: `spec_check.check` (implementations, families, names, profiles), profile
validation, and which forms are usable on a machine and why not."""

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_catalog import Catalog, SpecError
from flash_catalog.catalog.availability import Machine, availability
from flash_catalog.catalog.catalog import specs_dir
from flash_catalog.catalog.profiles import load_profiles, profile_problems, read_profile
from flash_catalog.catalog.spec_check import FileKind, check

SDPA = (specs_dir() / "attention_core" / "sdpa_dense.toml").read_text()


def spec(folder: Path, name: str, implementation: str = "flash_catalog.forms.sdpa_dense:SdpaDense") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(SDPA.replace('name = "sdpa_dense"', f'name = "{name}"').replace(
        "flash_catalog.forms.sdpa_dense:SdpaDense", implementation))
    return path


def profile(folder: Path, name: str, text: str) -> Path:
    (folder / "profiles").mkdir(exist_ok=True)
    path = folder / "profiles" / f"{name}.toml"
    path.write_text(f'name = "{name}"\n{text}')
    return path


def problems(report, path: Path) -> list[str]:
    return [p.message for f in report.files if f.path == path for p in f.problems]


def test_the_shipped_catalog_and_profiles_check_clean():
    report = check()
    assert report.ok, "\n".join(report.lines())
    assert report.count(FileKind.SPEC) == 13 and report.count(FileKind.PROFILE) == 8


@pytest.mark.parametrize("implementation,message", [
    ("no_such_module_abc:Form", "allowed: an importable 'module:Class' (no module 'no_such_module_abc')"),
    ("noisy_form:NoSuchClass", "allowed: an importable 'module:Class' (noisy_form has no 'NoSuchClass')"),
    ("flash_catalog.catalog.specs:PRECISIONS",
     "(flash_catalog.catalog.specs has a tuple, not a class, as 'PRECISIONS')"),
    ("flash_catalog.forms.fp8_rowwise:Fp8RowwiseFfn", "a vision_ffn form; allowed: a subclass of "
                                                      "flash_catalog.forms.base.AttentionForm (family attention_core)"),
    ("flash_catalog.catalog.catalog:Catalog",
     "not a form; allowed: a subclass of flash_catalog.forms.base.AttentionForm"),
])
def test_the_implementation_is_imported_and_must_be_a_form_of_its_family(tmp_path, implementation, message):
    path = spec(tmp_path, "typo", implementation)
    report = check([path])
    assert not report.ok
    [found] = problems(report, path)
    assert found.startswith(f"field 'implementation' is '{implementation}'") and message in found, found


def test_an_import_failure_names_the_module_and_the_error(tmp_path, monkeypatch):
    (tmp_path / "raising_form.py").write_text("raise RuntimeError('kernel table missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = spec(tmp_path, "raising", "raising_form:Form")
    [found] = problems(check([path]), path)
    assert "(importing raising_form raised RuntimeError: kernel table missing)" in found


def test_a_missing_optional_dependency_is_a_note_not_an_error(tmp_path):
    path = spec(tmp_path, "needs", "needs_missing_dependency:Form")
    report = check([path])
    assert report.ok
    assert report.files[0].notes == ("implementation needs_missing_dependency:Form not imported here: needs "
                                     "definitely_missing_package_xyz, which is not installed (its class was not "
                                     "checked)",)
    assert f"note  {path}: implementation needs_missing_dependency:Form" in "\n".join(report.lines())


def test_names_clash_within_the_files_and_with_the_shipped_catalog_when_extending(tmp_path):
    a, b = spec(tmp_path, "mine"), tmp_path / "again.toml"
    b.write_text(a.read_text())
    report = check([a, b])
    assert problems(report, a) == []
    assert problems(report, b) == [f"field 'name' is 'mine'; allowed: a name not already used (also declared in {a})"]
    (tmp_path / "other").mkdir()
    shadow = spec(tmp_path / "other", "sdpa_dense")
    assert check([shadow]).ok  # alone, it replaces the shipped catalog
    [clash] = problems(check([shadow], extend=True), shadow)
    assert f"also declared in {specs_dir() / 'attention_core' / 'sdpa_dense.toml'}" in clash
    assert check([specs_dir()], extend=True).ok  # the shipped files are not counted twice


def test_profiles_name_forms_of_the_right_family_from_the_catalog(tmp_path):
    spec(tmp_path, "mine")
    good = profile(tmp_path, "mine_first", 'attention_forms = ["mine", "sdpa_dense"]\n')
    wrong = profile(tmp_path, "wrong", 'attention_forms = ["fp8_rowwise", "nope"]\nffn_forms = ["mine"]\n')
    stray = profile(tmp_path, "stray", 'projections = ["*.to_q"]\ncolour = "red"\n')
    report = check([tmp_path], extend=True)
    assert problems(report, good) == []
    assert problems(report, wrong) == [
        "field 'attention_forms' names 'fp8_rowwise' (a form of vision_ffn, not attention_core); allowed: "
        "flex_blocksparse, grouped_batch, grouped_tiles, mine, sdpa_dense, sage2_fp16, sage2_fp16_cuda, sage2_fp8, "
        "sage2_fp8_cuda, nvfp4_attention",
        "field 'attention_forms' names 'nope' (no such form in the catalog); allowed: flex_blocksparse, "
        "grouped_batch, grouped_tiles, mine, sdpa_dense, sage2_fp16, sage2_fp16_cuda, sage2_fp8, sage2_fp8_cuda, "
        "nvfp4_attention",
        "field 'ffn_forms' names 'mine' (a form of attention_core, not vision_ffn); allowed: int8_rowwise, "
        "fp8_rowwise, fp8_rowwise_up, nvfp4_w4a4",
    ]
    assert problems(report, stray) == ["unknown field 'colour'; allowed: name, description, attention_forms, "
                                       "ffn_forms, projections"]
    assert check([tmp_path]).files[1].kind is FileKind.PROFILE
    assert "names 'sdpa_dense' (no such form" in "\n".join(check([tmp_path]).lines())  # without the shipped specs


def test_profile_files_alone_are_checked_against_the_shipped_catalog(tmp_path):
    path = profile(tmp_path, "fast", 'attention_forms = ["sage2_fp8", "sage3"]\n')
    report = check([path])
    assert [f.kind for f in report.files] == [FileKind.PROFILE]
    assert problems(report, path)[0].startswith("field 'attention_forms' names 'sage3' (no such form in the catalog)")


def test_profile_loading_reports_every_problem_and_duplicate_names(tmp_path):
    (tmp_path / "a.toml").write_text('name = "same"\nffn_forms = "fp8_rowwise"\n')
    (tmp_path / "b.toml").write_text('name = "same"\n')
    (tmp_path / "c.toml").write_text('name = "same"\n')
    (tmp_path / "d.toml").write_text('name = \n')
    with pytest.raises(SpecError) as err:
        load_profiles(tmp_path)
    assert [(p.path.name, p.field) for p in err.value.problems] == [
        ("a.toml", "ffn_forms"), ("c.toml", "name"), ("d.toml", None)]
    assert "not valid TOML" in err.value.problems[2].message
    fast = read_profile(tmp_path / "b.toml")
    assert fast.path == tmp_path / "b.toml" and fast.attention_forms is None
    assert profile_problems(fast, Catalog.shipped()) == []


def test_every_shipped_form_has_an_answer_on_a_cpu_only_machine():
    cpu = Machine()
    rows = {s.name: availability(s, cpu) for s in Catalog.shipped().specs}
    assert rows["sdpa_dense"].devices == ("cpu",) and rows["sdpa_dense"].reasons == ("CUDA: torch sees no CUDA device",)
    assert not rows["sage2_fp8"].usable
    assert rows["sage2_fp8"].reasons == ("CPU: not in its envelope (devices: CUDA)", "CUDA: torch sees no CUDA device")


def test_usable_devices_follow_the_capability_and_emulation():
    gpus = Machine(((8, 0), (9, 0)))
    rows = {s.name: availability(s, gpus) for s in Catalog.shipped().specs}
    assert rows["sage2_fp8"].devices == ("cuda:1",)
    assert rows["sage2_fp8"].reasons == ("CPU: not in its envelope (devices: CUDA)", "cuda:0: sm_80 below its sm>=89")
    assert rows["nvfp4_attention"].devices == ("cuda:0 (emulated, with allow_emulation=True)",
                                               "cuda:1 (emulated, with allow_emulation=True)")
    assert rows["fp8_rowwise"].devices == ("cpu", "cuda:1")
    assert gpus.describe() == "CPU and 2 CUDA device(s): cuda:0 sm_80, cuda:1 sm_90"


def test_a_missing_requirement_or_import_makes_a_form_unusable_everywhere(tmp_path):
    path = spec(tmp_path, "needs", "needs_missing_dependency:Form")
    path.write_text(path.read_text().replace('requires = ["torch>=2.5"]', 'requires = ["torch>=2.5", "nopkg_xyz>=1"]'))
    [row] = [availability(s, Machine(((9, 0),))) for s in Catalog.load([path]).specs]
    assert not row.usable
    assert row.reasons == ("requires nopkg_xyz>=1, nopkg_xyz is not installed",
                           "implementation needs_missing_dependency:Form: needs definitely_missing_package_xyz, "
                           "which is not installed")


LITERALS = ('"x"', "7", "-1.5", "true", "[]", '[1, "a"]', "{ a = 1 }", "1979-05-27T07:32:00Z", '"\u00e9t\u00e9"', "nan")
"""TOML values of every kind, to write in place of a field's value."""


def edited_files(folder: Path):
    """Every shipped spec and profile file with one field's value replaced by each of `LITERALS`, as
    (dotted field, path of the edited copy); a copy of a profile lies in a `profiles/` folder."""
    for source in sorted(specs_dir().rglob("*.toml")):
        lines = source.read_text().splitlines()
        table = ""
        for i, line in enumerate(lines):
            if line.startswith("["):
                table = line.strip("[] ")
            key = re.match(r"^(\w+) = ", line)
            if key is None:
                continue
            end = i + 1  # a multi-line array's continuation lines go with it
            if line.split("=", 1)[1].strip().startswith("[") and not line.rstrip().endswith("]"):
                while not lines[end - 1].rstrip().endswith("]"):
                    end += 1
            for literal in LITERALS:
                edited = lines[:i] + [f"{key.group(1)} = {literal}"] + lines[end:]
                target = folder / source.parent.name / source.name
                target.parent.mkdir(exist_ok=True)
                target.write_text("\n".join(edited) + "\n")
                yield (f"{table}.{key.group(1)}" if table else key.group(1)), target


def test_every_field_of_every_spec_and_profile_is_checked_naming_the_file_and_the_field(tmp_path):
    """Each field of the shipped files in turn given a value of another kind: the check reports problems naming the
    file and that field, or another field it contradicts naming it (or accepts the value); it never raises."""
    refused = 0
    for field, path in edited_files(tmp_path):
        report = check([path])
        [found] = report.files
        assert found.path == path
        if found.ok:
            continue
        refused += 1
        assert all(p.path == path for p in found.problems), found.lines()
        assert any(p.field == field or field in p.message for p in found.problems), (field, found.lines())
    assert refused > 300, refused


@pytest.mark.parametrize("encode,message", [
    (lambda text: text.encode("utf-16"), "not a UTF-8 TOML file: UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda text: text.encode("utf-16-le"), "not a UTF-8 TOML file: UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda text: text.encode("utf-32"), "not a UTF-8 TOML file: UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda text: (text + "# \u00e9t\u00e9\n").encode("latin-1"),
     "not a UTF-8 TOML file: not UTF-8 text: byte "),
    (lambda text: __import__("gzip").compress(text.encode()),
     "not a UTF-8 TOML file: gzip-compressed data: decompress it first"),
    (lambda text: b"x = " + b"[" * 100_000, "not valid TOML: "),
    (lambda text: b"x = " + b"1" * 5000, "not valid TOML: "),
])
@pytest.mark.parametrize("kind", ["spec", "profile"])
def test_a_spec_or_profile_file_that_is_not_utf8_toml_is_one_problem_naming_the_file(tmp_path, capsys, encode,
                                                                                    message, kind):
    from flash_catalog.cli.main import main

    text = SDPA if kind == "spec" else (specs_dir() / "profiles" / "fp8_balance.toml").read_text()
    path = (tmp_path / "profiles" if kind == "profile" else tmp_path) / "encoded.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(encode(text))
    [found] = check([path]).files
    [problem] = found.problems
    assert problem.path == path and message in problem.message, problem
    assert main(["specs", "check", str(path)]) == 1
    printed = capsys.readouterr().out
    assert all(len(line) <= 120 for line in printed.splitlines())
    assert f"error {path}: {message}" in " ".join(printed.split())  # a long line wraps at 120 columns


def test_a_utf8_spec_with_a_byte_order_mark_checks_clean(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + SDPA.encode())
    assert check([path]).ok


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_any_bytes_in_a_spec_file_give_a_report(tmp_path, raw):
    path = tmp_path / "fuzzed.toml"
    path.write_bytes(raw)
    [found] = check([path]).files
    assert found.path == path and all(p.path == path for p in found.problems)
