"""`[hub]` specs: an attention function from a kernel-hub package, resolved through `kernels`.

The kernel is our own Triton sage2 (FP16 P.V, through Triton's interpreter on the CPU) packaged as a
universal (`torch-universal`) build in a temporary folder, loaded with `get_local_kernel`, through
`LOCAL_KERNELS`, or, with the caller's opt-in, from a hub cache laid out as `kernels` downloads it. Every way
of not getting the kernel is one `KernelUnavailable` refusal, and the next form binds. Nothing here touches
the network: the hub is offline, the cache is a temporary folder, and opening a socket fails the test.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from flash_catalog import Catalog, KernelUnavailable, SpecError, attach, detach, load_spec
from flash_catalog.catalog.catalog import build_form, specs_dir
from flash_catalog.cli.main import main
from flash_catalog.forms.hub import HubAttention, resolve_function
from flash_catalog.forms.unavailable import Unavailable
from test_grouped_hosts import Block

kernels = pytest.importorskip("kernels")

REPO = "flash-catalog-tests/sage2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SITE, Q = "<model>#0", "q=(2,2,17,64)"  # the one site of `block()` and its shape at `x()`

SAGE2_PACKAGE = '''
from flash_catalog.kernels.sage2.triton_kernel import sage2_attention


def attention(q, k, v, *, scale=None, is_causal=False, pv="fp8"):
    return sage2_attention(q, k, v, scale=scale, pv=pv, is_causal=is_causal)
'''

HUB_SPEC = f'''
name = "hub_sage2"
family = "attention_core"
precision = "int8"
description = "sage2 (INT8 QK, FP16 PV) from a kernel-hub package"

[hub]
repo = "{REPO}"
version = 1
function = "attention"
kwargs = {{ pv = "fp16" }}

[envelope]
devices = ["cpu", "cuda"]
dtypes = ["float16", "bfloat16"]
head_dims = [64, 128]
masks = ["none", "all_pass"]
causal = true
gqa = true
requires = ["torch>=2.5", "triton>=3.2"]

[accuracy]
min_cosine = 0.9999
max_rel_err = 0.1
'''


def metadata(**extra) -> dict:
    return {"id": "flash_catalog_tests_sage2", "name": "flash-catalog-sage2", "version": 1,
            "license": "Apache-2.0", "backend": {"type": "cuda"}, "python-depends": [], **extra}


def make_build(root: Path, package: str = SAGE2_PACKAGE, variant: str = "torch-universal", **extra) -> Path:
    """A kernel folder as kernel-builder lays it out: build/<variant>/{metadata.json, __init__.py}."""
    folder = root / "build" / variant
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps(metadata(**extra)))
    (folder / "__init__.py").write_text(package)
    return root


def make_cache(cache: Path, package: str = SAGE2_PACKAGE) -> None:
    """The hub cache as `kernels` leaves it after downloading version 1 (branch v1) of REPO."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=REPO, repo_type="kernel")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text(COMMIT)
    make_build(repo / "snapshots" / COMMIT, package)


def catalog(tmp_path: Path, spec: str = HUB_SPEC, **replace: str) -> Catalog:
    """The hub spec (with textual replacements) and sdpa_dense, the form tried next."""
    folder = tmp_path / "specs"
    folder.mkdir(exist_ok=True)
    for old, new in replace.items():
        assert old in spec, old
        spec = spec.replace(old, new)
    (folder / "hub_sage2.toml").write_text(spec)
    (folder / "sdpa_dense.toml").write_text((specs_dir() / "attention_core" / "sdpa_dense.toml").read_text())
    return Catalog.load([folder])


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block(dim=128, heads=2).eval().half()


def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 17, 128, dtype=torch.float16)


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, an empty hub cache of our own, no LOCAL_KERNELS from the caller's environment."""
    import huggingface_hub.constants
    import kernels.resolver

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.setattr(kernels.resolver, "CACHE_DIR", str(cache))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("a hub test tried to use the network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def bind_and_compare(cat: Catalog, **options) -> None:
    model, inputs = block(), x()
    with torch.no_grad():
        reference = model(inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = attach(model, (inputs,), catalog=cat, attention_forms=["hub_sage2"], min_speedup=0, timing_rounds=1,
                  **options)
    site = plan.site(SITE)
    assert site.outcome == "bound" and site.form == "hub_sage2", str(plan)
    assert site.accuracy[0] >= 0.9999
    assert site.shapes[0].reason.endswith(f"hub {REPO} v1: attention")
    with torch.no_grad():
        attached = model(inputs)
    assert plan.routed == {SITE: 1}
    cos = torch.nn.functional.cosine_similarity(attached.double().flatten(), reference.double().flatten(), dim=0)
    assert cos > 0.9999
    assert (attached.float() - reference.float()).abs().max() < 0.05
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(inputs), reference)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.interpreter
def test_a_local_build_named_by_the_spec_binds_and_detaches_bit_exactly(tmp_path):
    """`hub.local`: kernels.get_local_kernel(folder); no opt-in needed for code on disk."""
    make_build(tmp_path / "sage2-kernel")
    bind_and_compare(catalog(tmp_path, **{"version = 1": 'version = 1\nlocal = "../sage2-kernel"'}))


@pytest.mark.interpreter
def test_a_local_kernels_build_binds_and_detaches_bit_exactly(tmp_path, monkeypatch):
    """LOCAL_KERNELS maps the spec's repo to a folder: kernels.get_kernel loads it, nothing is downloaded."""
    make_build(tmp_path / "sage2-kernel")
    monkeypatch.setenv("LOCAL_KERNELS", f"other/kernel=/nowhere:{REPO}={tmp_path / 'sage2-kernel'}")
    bind_and_compare(catalog(tmp_path))


@pytest.mark.interpreter
def test_a_trusted_hub_kernel_loads_from_the_offline_cache(tmp_path, offline):
    """With the caller's opt-in the hub path runs kernels.get_kernel(repo, version=1) (here from the cache)."""
    make_cache(offline)
    bind_and_compare(catalog(tmp_path), trust_remote_code=[REPO])


@pytest.mark.interpreter
def test_resolve_function_gives_the_packaged_function(tmp_path):
    make_build(tmp_path / "k")
    spec = load_spec(catalog(tmp_path, **{"version = 1": 'version = 1\nlocal = "../k"'}).specs[0].path)
    assert spec.hub.local == (tmp_path / "specs" / ".." / "k")
    fn = resolve_function(spec.hub)
    q, k, v = (torch.randn(1, 2, 17, 64, dtype=torch.float16) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = fn(q, k, v, scale=None, is_causal=False, pv="fp16")
    assert out.dtype == torch.float16 and (out.float() - expected).abs().max() < 0.02
    form = build_form(spec)
    assert isinstance(form, HubAttention) and form.kwargs == {"pv": "fp16"}


def no_kernels(tmp_path, monkeypatch, offline):
    monkeypatch.setitem(sys.modules, "kernels", None)
    return {}, "the `kernels` package is not installed (pip install 'flash_catalog[hub]', kernels>=0.17)"


def missing_local_folder(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'not-built'}")
    return {}, f"LOCAL_KERNELS build {tmp_path / 'not-built'}: no such folder"


def missing_spec_folder(tmp_path, monkeypatch, offline):
    return {"version = 1": 'version = 1\nlocal = "/no/such/kernel"'}, "local build /no/such/kernel: no such folder"


def no_build_for_this_torch(tmp_path, monkeypatch, offline):
    make_build(tmp_path / "k", variant="torch27-cxx11-cu126-x86_64-linux")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'k'}")
    return {}, (f"from LOCAL_KERNELS build {tmp_path / 'k'}: no usable build (FileNotFoundError: Cannot find a "
                f"build variant for this system in {tmp_path / 'k'}", "torch27-cxx11-cu126-x86_64-linux: ")


def import_error_inside(tmp_path, monkeypatch, offline):
    make_build(tmp_path / "k", package="import definitely_missing_package_xyz\n")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'k'}")
    return {}, (f"from LOCAL_KERNELS build {tmp_path / 'k'}: importing the package failed (ModuleNotFoundError: "
                f"No module named 'definitely_missing_package_xyz')")


def function_missing(tmp_path, monkeypatch, offline):
    make_build(tmp_path / "k")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'k'}")
    return ({'function = "attention"': 'function = "flash_attn"'},
            "the package has no function 'flash_attn' (it has: attention, sage2_attention)")


def hub_without_opt_in(tmp_path, monkeypatch, offline):
    make_cache(offline)  # cached, so only the missing opt-in stops it
    return {}, (f"loading code from the Hugging Face Hub needs the caller's opt-in: attach(..., "
                f"trust_remote_code=True) or trust_remote_code=['{REPO}']; or a local build: "
                f"LOCAL_KERNELS='{REPO}=/path/to/kernel'")


def local_build_with_hub_dependencies(tmp_path, monkeypatch, offline):
    make_build(tmp_path / "k", **{"kernel-depends": [{"repo-id": "someone/activation", "version": 1}]})
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'k'}")
    return {}, (f"LOCAL_KERNELS build {tmp_path / 'k'} depends on hub kernels (someone/activation); loading "
                f"code from the hub needs attach(..., trust_remote_code=True) or "
                f"trust_remote_code=['someone/activation'], or LOCAL_KERNELS entries for them")


def version_not_found(tmp_path, monkeypatch, offline):
    make_cache(offline)
    return ({"version = 1": "version = 2"},
            "from the hub cache (HF_HUB_OFFLINE): not resolved (ValueError: Version 2 not found, available "
            "versions: 1)")


def offline_and_not_cached(tmp_path, monkeypatch, offline):
    return {}, (f"from the hub cache (HF_HUB_OFFLINE): not resolved (ValueError: Version 1 of '{REPO}' is not "
                f"available in the local cache and Hugging Face Hub is in offline mode.",)


@pytest.mark.parametrize("case", [no_kernels, missing_local_folder, missing_spec_folder, no_build_for_this_torch,
                                  import_error_inside, function_missing, hub_without_opt_in,
                                  local_build_with_hub_dependencies, version_not_found, offline_and_not_cached])
def test_every_way_of_not_getting_the_kernel_is_one_refusal_and_the_next_form_binds(tmp_path, monkeypatch,
                                                                                     offline, case):
    replace, expected = case(tmp_path, monkeypatch, offline)
    trust = [REPO] if case in (version_not_found, offline_and_not_cached) else False
    cat = catalog(tmp_path, **replace)
    version = "2" if case is version_not_found else "1"
    form = build_form(cat.specs[0], trust_remote_code=trust)
    assert isinstance(form, Unavailable)

    model, inputs = block(), x()
    with torch.no_grad():
        reference = model(inputs)
    plan = attach(model, (inputs,), catalog=cat, attention_forms=["hub_sage2", "sdpa_dense"], min_speedup=0,
                  timing_rounds=1, trust_remote_code=trust)
    shape = plan.site(SITE).shapes[0]
    assert shape.outcome == "bound" and shape.form == "sdpa_dense", str(plan)
    refusal = shape.trail[0]
    prefix = f"hub_sage2: implementation unavailable (hub kernel {REPO} v{version}: "
    assert refusal.startswith(prefix) and refusal.endswith(f") at {Q}"), refusal
    if isinstance(expected, str):  # our own words: the whole line
        assert refusal == f"{prefix}{expected}) at {Q}"
    else:  # kernels' words, which name paths and versions: the parts that matter
        assert all(part in refusal for part in expected), refusal
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(inputs), reference)


def test_resolution_failures_raise_kernel_unavailable_only(tmp_path):
    spec = catalog(tmp_path).specs[0]
    with pytest.raises(KernelUnavailable, match="needs the caller's opt-in"):
        resolve_function(spec.hub)
    with pytest.raises(KernelUnavailable, match="not available in the local cache"):
        resolve_function(spec.hub, trust_remote_code=True)


def test_a_function_that_returns_the_wrong_thing_fails_to_run_and_the_next_form_binds(tmp_path, monkeypatch):
    make_build(tmp_path / "k", package="def attention(q, k, v, *, scale=None, is_causal=False, pv=None):\n"
                                       "    return q.float()\n")
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={tmp_path / 'k'}")
    model = block()
    plan = attach(model, (x(),), catalog=catalog(tmp_path), attention_forms=["hub_sage2", "sdpa_dense"],
                  min_speedup=0, timing_rounds=1)
    shape = plan.site(SITE).shapes[0]
    assert shape.form == "sdpa_dense"
    assert shape.trail[0] == (f"hub_sage2: failed to run (RuntimeError: {REPO} v1: attention returned float32 "
                              f"(2,2,17,64) on cpu; expected float16 (2,2,17,64) on cpu) at {Q}")
    detach(plan)


def test_trust_remote_code_must_be_a_bool_or_a_list_of_repos(tmp_path):
    with pytest.raises(TypeError, match=r"write \['owner/name'\]"):
        attach(block(), (x(),), catalog=catalog(tmp_path), trust_remote_code="owner/name")
    with pytest.raises(TypeError, match="expected True, False or a list"):
        attach(block(), (x(),), catalog=catalog(tmp_path), trust_remote_code=1)


def test_the_opt_in_is_recorded_in_the_plan(tmp_path):
    plan = attach(block(), (x(),), catalog=catalog(tmp_path), attention_forms=["sdpa_dense"],
                  trust_remote_code=[REPO])
    assert plan.options.trust_remote_code == (REPO,)
    detach(plan)


@pytest.mark.parametrize("old,new,field,value,allowed", [
    ("version = 1", 'version = "1"', "hub.version", "'1'", "a non-negative integer major version"),
    ("version = 1", "", "hub.version", "missing", "exactly one of 'hub.version'"),
    ("version = 1", 'version = 1\nrevision = "main"', "hub.version", "{'version': 1, 'revision': 'main'}",
     "exactly one of 'hub.version'"),
    ("version = 1", 'revision = "a b"', "hub.revision", "'a b'", "a branch, tag or commit"),
    (f'repo = "{REPO}"', 'repo = "sage2"', "hub.repo", "'sage2'", "a hub repository id such as 'owner/name'"),
    ('function = "attention"', 'function = "2fast"', "hub.function", "'2fast'", "the name of the attention"),
    ('masks = ["none", "all_pass"]', 'masks = ["none", "key_padding"]', "envelope.masks", "'key_padding'",
     "none, all_pass (a [hub] function takes no mask)"),
    ('family = "attention_core"', 'family = "vision_ffn"', "family", "'vision_ffn'",
     "attention_core (a [hub] function serves attention only)"),
    ("version = 1", "version = 1\ntrust_remote_code = true", "hub.trust_remote_code", "True",
     "no such field: trusting hub code is the caller's decision, attach(..., trust_remote_code=True)"),
    ('kwargs = { pv = "fp16" }', "kwargs = { scale = 0.5 }", "hub.kwargs", "'scale'",
     "identifiers other than scale and is_causal"),
    ('kwargs = { pv = "fp16" }', "kwargs = { pv = [1] }", "hub.kwargs.pv", "[1]", "a table of keyword arguments"),
    ('kwargs = { pv = "fp16" }', 'kwargs = "fp16"', "hub.kwargs", "'fp16'", "a table of keyword arguments"),
])
def test_bad_hub_spec_names_file_field_value_and_allowed(tmp_path, old, new, field, value, allowed):
    path = tmp_path / "hub.toml"
    assert old in HUB_SPEC
    path.write_text(HUB_SPEC.replace(old, new))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}: field '{field}' is {value}; allowed: ")
    assert allowed in str(err.value).split("; allowed: ", 1)[1]


def test_a_spec_names_exactly_one_of_implementation_and_hub(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text(HUB_SPEC.replace("[hub]", 'implementation = "flash_catalog.forms.sage2:Sage2Fp16"\n[hub]'))
    with pytest.raises(SpecError, match=r"fields 'implementation' and 'hub' are both set; allowed: exactly one"):
        load_spec(path)
    path.write_text(HUB_SPEC.split("[hub]")[0] + "[envelope]" + HUB_SPEC.split("[envelope]")[1])
    with pytest.raises(SpecError, match=r"field 'implementation' is missing; allowed: 'package.module:ClassName' "
                                        r"\(or a \[hub\] table instead\)"):
        load_spec(path)
    path.write_text(HUB_SPEC.replace("[hub]", "[hub]\ncolour = 1"))
    with pytest.raises(SpecError, match=r"unknown field 'hub.colour'; allowed: function, kwargs, local, repo, "
                                        r"revision, version"):
        load_spec(path)


def test_hub_spec_fields_and_the_cli(tmp_path, capsys):
    path = tmp_path / "hub_sage2.toml"
    path.write_text(HUB_SPEC.replace("version = 1", 'revision = "v1"\nlocal = "kernel"'))
    spec = load_spec(path)
    assert spec.implementation == "flash_catalog.forms.hub:HubAttention"
    assert spec.hub.repo == REPO and spec.hub.revision == "v1" and spec.hub.version is None
    assert spec.hub.local == tmp_path / "kernel" and spec.hub.kwargs == (("pv", "fp16"),)
    assert spec.hub.describe() == f"{REPO}@v1"
    assert main(["specs", "check", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # a line over 120 columns wraps
    assert f"ok {path}: hub_sage2 (attention_core, int8, hub {REPO}@v1:attention)" in out
    assert main(["specs", "list", str(path)]) == 0
    assert f"hub: {REPO}@v1, function attention, kwargs {{'pv': 'fp16'}}, local build {tmp_path / 'kernel'}" in (
        " ".join(capsys.readouterr().out.split()))  # the line wraps at 120 columns
    bad = tmp_path / "bad.toml"
    bad.write_text(HUB_SPEC.replace("version = 1", "version = -1"))
    assert main(["specs", "check", str(bad)]) == 1
    assert f"{bad}: field 'hub.version' is -1; allowed: a non-negative integer major version such as 1" in (
        " ".join(capsys.readouterr().out.split()))  # a line over 120 columns wraps
