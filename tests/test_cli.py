"""The console script: demo end to end on the CPU, spec listing and linting with their exit codes."""

import json

from flash_catalog.cli import main


def test_demo_runs_and_verifies_the_restore(capsys, tmp_path):
    receipt = tmp_path / "receipt.json"
    assert main(["demo", "--model", "wan", "--json", str(receipt)]) == 0
    out = capsys.readouterr().out
    assert "host: tiny wan" in out
    assert "blocks.0.attn2#1" in out
    assert "detach: host restored bit-exactly (outputs and state_dict equal)" in out
    data = json.loads(receipt.read_text())
    assert len(data["sites"]) == 6 and data["environment"]["device"] == "cpu"


def test_demo_unknown_form_is_an_error(capsys):
    assert main(["demo", "--model", "flux", "--forms", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown attention_core form(s) 'nope'; known: flex_blocksparse, grouped_batch" in err
    assert "sdpa_dense" in err


def test_specs_list_and_check(capsys, tmp_path):
    assert main(["specs", "list"]) == 0
    out = capsys.readouterr().out
    assert "sdpa_dense  [attention_core, native]" in out and "masks=['none', 'all_pass']" in out
    ffn = out.split("fp8_rowwise  [vision_ffn, fp8]")[1].split("\n")[1]  # the envelope line of an FFN spec
    assert "devices=['cpu', 'cuda']" in ffn and "masks=" not in ffn and "causal=" not in ffn
    assert main(["specs", "check"]) == 0
    assert "0 bad" in capsys.readouterr().out

    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nfamily = "attention_core"\nimplementation = "a.b:C"\nprecision = "fp7"\n')
    assert main(["specs", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: field 'precision' is 'fp7'; allowed: native, int8, fp8, fp4" in out
    assert "1 spec file(s), 1 bad" in out
