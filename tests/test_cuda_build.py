"""Building a CUDA source on first use: where nvcc is looked for, the cache, the lock, failures (CPU: host code)."""

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from flash_catalog.kernels import cuda_build
from flash_catalog.kernels.cuda_build import BuildStatus, arch_refusal, find_nvcc, forget_builds, load_library

PROBE = """
__global__ void fc_add_one(int *x) { x[threadIdx.x] += 1; }
extern "C" int fc_probe(int x) { return x + %d; }
"""


@pytest.fixture(autouse=True)
def _fresh_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_CATALOG_CACHE", str(tmp_path / "cache"))
    forget_builds()
    yield
    forget_builds()


def _fake_nvcc(folder: Path, text: str = "") -> Path:
    folder.mkdir(parents=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '{text}'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_find_nvcc_looks_in_order_and_the_pin_is_the_only_place_looked(tmp_path, monkeypatch):
    home, on_path, pinned = (_fake_nvcc(tmp_path / name / "bin") for name in ("home", "path", "pinned"))
    monkeypatch.delenv("FLASH_CATALOG_NVCC", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_nvcc() == home
    monkeypatch.delenv("CUDA_HOME")
    assert find_nvcc() == on_path
    monkeypatch.setenv("FLASH_CATALOG_NVCC", str(pinned))
    assert find_nvcc() == pinned
    monkeypatch.setenv("FLASH_CATALOG_NVCC", str(tmp_path / "missing" / "nvcc"))
    assert find_nvcc() is None
    monkeypatch.setenv("FLASH_CATALOG_NVCC", "")
    assert find_nvcc() is None


def test_the_pip_nvcc_is_found_through_the_nvidia_namespace_package(tmp_path, monkeypatch):
    wheel_nvcc = _fake_nvcc(tmp_path / "site" / "nvidia" / "cu13" / "bin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert wheel_nvcc in cuda_build._pip_cuda_tools("nvcc")


def test_no_nvcc_is_refused_naming_the_fix(tmp_path, monkeypatch):
    source = tmp_path / "probe.cu"
    source.write_text(PROBE % 1)
    monkeypatch.delenv("FLASH_CATALOG_NVCC", raising=False)
    with monkeypatch.context() as patch:
        patch.setattr(cuda_build, "find_nvcc", lambda: None)  # this machine may well have one
        build = load_library(source)
    assert build.status is BuildStatus.NO_NVCC and build.library is None and build.path is None
    assert "no nvcc found" in build.refusal() and "pip install 'flash_catalog[cuda]'" in build.refusal()
    assert "\n" not in build.refusal()
    forget_builds()

    monkeypatch.setenv("FLASH_CATALOG_NVCC", "")
    assert "FLASH_CATALOG_NVCC is set empty" in load_library(source).refusal()
    forget_builds()
    monkeypatch.setenv("FLASH_CATALOG_NVCC", str(_fake_nvcc(tmp_path / "fake", "not a compiler")))
    build = load_library(source)
    assert build.status is BuildStatus.NO_NVCC and "printed no version" in build.refusal()


def test_a_source_path_is_resolved_once_per_spelling(tmp_path, monkeypatch):
    source = tmp_path / "probe.cu"
    source.write_text(PROBE % 1)
    link = tmp_path / "link.cu"
    link.symlink_to(source)
    monkeypatch.setenv("FLASH_CATALOG_NVCC", "")  # nothing compiles: the refusal is memoised like a build
    first = load_library(source)
    assert "FLASH_CATALOG_NVCC is set empty" in first.refusal()
    assert load_library(str(source)) is first and load_library(link) is first  # one file, one result
    with monkeypatch.context() as patch:  # a form asks on every call: no file-system call after the first
        patch.setattr(Path, "resolve", lambda *a, **k: pytest.fail("resolved a source path again"))
        assert load_library(source) is first and load_library(str(link)) is first
    forget_builds()
    monkeypatch.setenv("FLASH_CATALOG_NVCC", str(_fake_nvcc(tmp_path / "fake", "not a compiler")))
    assert "printed no version" in load_library(source).refusal()  # forgotten: asked again


def test_an_nvcc_without_the_cuda_headers_is_refused_as_such(tmp_path, monkeypatch):
    nvcc = tmp_path / "bin" / "nvcc"  # answers --version like nvcc 13.0, fails everything else like a headerless one
    nvcc.parent.mkdir()
    nvcc.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "release 13.0, V13.0.88" && exit 0\n'
                    'echo "fatal error: cuda_runtime.h: No such file or directory" >&2; exit 1\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASH_CATALOG_NVCC", str(nvcc))
    source = tmp_path / "probe.cu"
    source.write_text(PROBE % 1)
    build = load_library(source)
    assert build.status is BuildStatus.NO_CUDA_HEADERS and "cuda_runtime.h" in build.refusal()
    assert "pip install 'flash_catalog[cuda]'" in build.refusal()


def test_a_build_is_cached_shared_with_a_waiting_process_and_keyed_by_the_source(tmp_path, monkeypatch):
    if find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    source = tmp_path / "probe.cu"
    source.write_text(PROBE % 1)
    build = load_library(source)
    if build.status is BuildStatus.NO_CUDA_HEADERS:
        pytest.skip(build.refusal())
    assert build.status is BuildStatus.BUILT, build.detail + "\n" + build.nvcc_output
    assert build.refusal() is None and build.seconds > 0 and build.path.parent == tmp_path / "cache" / "cuda"
    assert build.library.fc_probe(41) == 42
    assert load_library(source) is build  # memoised in this process

    forget_builds()
    with monkeypatch.context() as patch:
        patch.setattr(cuda_build, "_compile", lambda *a: pytest.fail("compiled a cached source"))
        cached = load_library(source)
    assert (cached.status, cached.path, cached.seconds) == (BuildStatus.CACHED, build.path, 0.0)

    source.write_text(PROBE % 2)
    forget_builds()
    changed = load_library(source)
    assert changed.status is BuildStatus.BUILT and changed.path != build.path and changed.library.fc_probe(41) == 43

    # Another process holds the lock while it builds: this one waits, then loads that build without compiling.
    finished = changed.path.read_bytes()
    changed.path.unlink()
    forget_builds()
    monkeypatch.setattr(cuda_build, "_compile", lambda *a: pytest.fail("compiled while another process built"))
    results = []
    with open(changed.path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(load_library(source)))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and not results
        changed.path.write_bytes(finished)
    waiter.join(timeout=30)
    assert results[0].status is BuildStatus.CACHED and results[0].library.fc_probe(41) == 43


def test_a_failed_build_carries_nvcc_errors_and_leaves_no_file(tmp_path):
    if find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    source = tmp_path / "broken.cu"
    source.write_text('extern "C" int fc_probe(int x) { return x + }\n')
    build = load_library(source)
    if build.status is BuildStatus.NO_CUDA_HEADERS:
        pytest.skip(build.refusal())
    assert build.status is BuildStatus.BUILD_FAILED and build.library is None and build.path is None
    assert "broken.cu" in build.refusal() and "error" in build.refusal() and "\n" not in build.refusal()
    assert "error" in build.nvcc_output and len(build.nvcc_output.splitlines()) <= cuda_build.STDERR_LINES
    left = os.listdir(tmp_path / "cache" / "cuda")
    assert [name for name in left if not name.endswith(".lock")] == []


def test_arch_refusal():
    assert arch_refusal((9, 0)) is None
    assert arch_refusal((8, 0)) == "the CUDA kernel is built for sm_90a (Hopper); this GPU is sm_80"
    assert arch_refusal((10, 0)) is not None  # arch-specific code runs on its own capability only
    assert arch_refusal((8, 6), "sm_80") is None and arch_refusal((9, 0), "sm_80") is not None
    with pytest.raises(ValueError, match="'hopper'"):
        arch_refusal((9, 0), "hopper")
    with pytest.raises(ValueError, match="sm_90a"):
        load_library(Path("any.cu"), arch="90a")
