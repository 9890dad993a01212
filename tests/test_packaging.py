"""What the wheel declares: license, typing marker, extras, the torch range."""

import tomllib
from pathlib import Path

import flash_catalog

ROOT = Path(__file__).resolve().parent.parent


def test_project_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert "torch>=2.5" in project["dependencies"]
    assert project["optional-dependencies"]["triton"] == ["triton>=3.2"]
    assert {req.split(">=")[0] for req in project["optional-dependencies"]["cuda"]} == {
        "nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl"}  # a pip-only toolchain: see cuda_build.py
    assert "Typing :: Typed" in project["classifiers"]
    assert set(project["urls"]) >= {"Homepage", "Repository", "Issues"}


def test_the_package_is_marked_typed():
    assert (Path(flash_catalog.__file__).parent / "py.typed").is_file()
