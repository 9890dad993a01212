"""Build a CUDA C++ source with nvcc on first use, cache the shared library, and load it with ctypes.

A CUDA form ships its kernel as one self-contained `.cu` file exposing `extern "C"` functions; nothing is
compiled at install time. The first `load_library` on a machine compiles it (seconds to minutes) into
`$FLASH_CATALOG_CACHE/cuda` (default `~/.cache/flash_catalog/cuda`), named by a hash of the source, arch, flags
and nvcc version, so later processes load it at once. cudart is linked statically: the library needs only the
driver's libcuda at run time. Several processes building at once (torchrun ranks) take a file lock: one
compiles, the others wait and load its result.

nvcc is looked for in `$FLASH_CATALOG_NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, PATH, `/usr/local/cuda/bin`,
then the pip packages of `flash_catalog[cuda]` (`nvidia-cuda-nvcc`). `FLASH_CATALOG_NVCC`, when set, is the only
place looked: a path pins the compiler, an empty value means "build nothing" (every CUDA form is then refused).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger("flash_catalog")

COMPILE_TIMEOUT_S = 1800
"""A compile that runs longer is stopped and reported as failed, so that a hung nvcc cannot hang an attach."""
STDERR_LINES = 12
"""How much of nvcc's error output a failed build carries (the log has all of it)."""
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr", "-cudart",
         "static")
"""nvcc's flags for every build (the arch and the caller's flags come on top); part of the cache key."""
_FIX = "pip install 'flash_catalog[cuda]' or set CUDA_HOME to a CUDA toolkit"
_ARCH = re.compile(r"sm_(\d+)(\d)([af]?)")
_ARCH_NAMES = {(8, 0): "Ampere", (8, 6): "Ampere", (8, 9): "Ada", (9, 0): "Hopper", (10, 0): "Blackwell",
               (12, 0): "Blackwell"}


class BuildStatus(Enum):
    BUILT = "built"  # compiled by this call
    CACHED = "cached"  # found in the cache
    NO_NVCC = "no_nvcc"
    NO_CUDA_HEADERS = "no_cuda_headers"  # nvcc found, but it finds no cuda_runtime.h / cuda_fp16.h (CCCL)
    BUILD_FAILED = "build_failed"
    LOAD_FAILED = "load_failed"


@dataclass(frozen=True)
class CudaBuild:
    """What `load_library` found: the loaded library, or why there is none.

    `detail` is one line: for a usable build, which nvcc built it for which arch; otherwise what failed and the
    fix. `nvcc_output` holds the first lines of nvcc's errors for BUILD_FAILED ("" otherwise). `seconds` is the
    compile time, 0 when nothing was compiled."""

    status: BuildStatus
    library: ctypes.CDLL | None
    path: Path | None
    detail: str
    nvcc_output: str
    seconds: float

    def refusal(self) -> str | None:
        """None when the library is loaded, else the one-line reason a CUDA form gives for refusing to run."""
        return None if self.library is not None else self.detail


def find_nvcc() -> Path | None:
    """The nvcc to build with (see the module docstring for the order), or None."""
    pinned = os.environ.get("FLASH_CATALOG_NVCC")
    if pinned is not None:
        return Path(pinned) if pinned and _is_executable(Path(pinned)) else None
    return find_cuda_tool("nvcc")


def find_cuda_tool(name: str) -> Path | None:
    """A CUDA toolkit program (`nvcc`, `cuobjdump`, ...): the first executable one in `$CUDA_HOME/bin`,
    `$CUDA_PATH/bin`, on PATH, in `/usr/local/cuda/bin`, or from NVIDIA's CUDA 13 pip wheels; None where none is."""
    homes = [os.environ.get(home) for home in ("CUDA_HOME", "CUDA_PATH")]
    candidates = [Path(home) / "bin" / name for home in homes if home]
    on_path = shutil.which(name)
    candidates += [Path(on_path)] if on_path else []
    candidates += [Path("/usr/local/cuda/bin") / name, *_pip_cuda_tools(name)]
    return next((c for c in candidates if _is_executable(c)), None)


def nvcc_version(nvcc: Path) -> str:
    """nvcc's full version, e.g. "13.0.88" (from `nvcc --version`); raises RuntimeError naming `nvcc` when it does
    not answer like nvcc."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{nvcc} does not run: {e}") from e
    match = re.search(r"\bV(\d+\.\d+\.\d+)", out)
    if match is None:
        raise RuntimeError(f"{nvcc} --version printed no version (is it nvcc?): {out.strip()[:200]!r}")
    return match.group(1)


def arch_refusal(device_capability: tuple[int, int], arch: str = "sm_90a") -> str | None:
    """None when a GPU of `device_capability` runs code built for `arch`, else the reason it does not.

    An arch-specific target (sm_90a) runs only on its own capability; a plain one (sm_80) on the same major
    version with an equal or higher minor (only SASS is built, no PTX to JIT for newer majors)."""
    major, minor, suffix = _parse_arch(arch)
    fits = device_capability == (major, minor) if suffix else (
        device_capability[0] == major and device_capability[1] >= minor)
    if fits:
        return None
    name = _ARCH_NAMES.get((major, minor))
    built_for = f"{arch} ({name})" if name else arch
    return f"the CUDA kernel is built for {built_for}; this GPU is sm_{device_capability[0]}{device_capability[1]}"


def load_library(source: Path, *, arch: str = "sm_90a", extra_flags: tuple[str, ...] = ()) -> CudaBuild:
    """`source` compiled for `arch` (from the cache when built before) and loaded; never raises for a missing or
    failing toolchain: the returned CudaBuild says why there is no library. Memoised per process (see
    `forget_builds`), also on `source` as given: a CUDA form asks on every call, and resolving the path is
    file-system calls."""
    return _load_as_given(source if isinstance(source, Path) else Path(source), arch, tuple(extra_flags))


@functools.cache
def _load_as_given(source: Path, arch: str, extra_flags: tuple[str, ...]) -> CudaBuild:
    _parse_arch(arch)
    return _load(source.resolve(), arch, extra_flags)


def forget_builds() -> None:
    """Forget this process's memoised `load_library` results (the on-disk cache stays)."""
    _load_as_given.cache_clear()
    _load.cache_clear()


@functools.cache
def _load(source: Path, arch: str, extra_flags: tuple[str, ...]) -> CudaBuild:
    nvcc = find_nvcc()
    if nvcc is None:
        return _failed(BuildStatus.NO_NVCC, _no_nvcc_reason())
    try:
        version = nvcc_version(nvcc)
    except RuntimeError as e:
        return _failed(BuildStatus.NO_NVCC, f"cannot build the CUDA kernel: {e}; {_FIX}")
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _failed(BuildStatus.BUILD_FAILED, f"cannot build the CUDA kernel: no cache folder ({e}); "
                       "set FLASH_CATALOG_CACHE to a writable folder")
    key = _key(source.read_bytes(), arch, extra_flags, version)
    target = cache / f"{source.stem}-{key}.so"
    built_by = f"{target.name}: built by nvcc {version} for {arch}"
    seconds, compiled = 0.0, False
    if not target.exists():
        with open(cache / f"{source.stem}-{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then find its result
            if not target.exists():
                command = _command(nvcc, source, arch, extra_flags)
                log.info("building %s with nvcc %s (first use; cached in %s)", source.name, version, cache)
                failure, seconds = _compile(command, target)
                if failure is not None:
                    return _classify_failure(nvcc, source, version, extra_flags, failure)
                compiled = True
                log.info("built %s in %.1f s", source.name, seconds)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as e:
        return CudaBuild(BuildStatus.LOAD_FAILED, None, target, f"cannot load the CUDA kernel {target}: {e}", "",
                         seconds)
    status = BuildStatus.BUILT if compiled else BuildStatus.CACHED
    return CudaBuild(status, library, target, built_by, "", seconds)


def _compile(command: list[str], target: Path) -> tuple[str | None, float]:
    """Runs `command` with its output going to a temporary file next to `target`, then moves that file into place
    (atomically: a reader sees the whole library or none). Returns nvcc's error output (None on success) and the
    seconds taken; a failure leaves no file behind."""
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}.", suffix=".partial")
    os.close(fd)
    start = time.perf_counter()
    try:
        result = subprocess.run([*command, "-o", partial], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            return (result.stderr + result.stdout).strip() or f"nvcc exited with code {result.returncode}", seconds
        os.chmod(partial, 0o755)  # mkstemp's 0600 would hide the library from other users of a shared cache
        os.replace(partial, target)
        return None, seconds
    except subprocess.TimeoutExpired:
        return f"nvcc ran past {COMPILE_TIMEOUT_S} s", time.perf_counter() - start
    finally:
        Path(partial).unlink(missing_ok=True)


def _classify_failure(nvcc: Path, source: Path, version: str, extra_flags: tuple[str, ...], output: str) -> CudaBuild:
    log.warning("nvcc %s failed on %s:\n%s", version, source, output)
    if not _finds_cuda_headers(nvcc, extra_flags):
        return _failed(BuildStatus.NO_CUDA_HEADERS,
                       f"cannot build the CUDA kernel: nvcc {nvcc} finds no cuda_runtime.h / cuda_fp16.h "
                       f"(the CUDA runtime and CCCL headers); {_FIX}")
    lines = output.splitlines()
    first_error = next((line for line in lines if "error" in line.lower()), lines[0])
    return CudaBuild(BuildStatus.BUILD_FAILED, None, None,
                     f"cannot build the CUDA kernel: nvcc {version} failed on {source.name}: {first_error.strip()}",
                     "\n".join(lines[:STDERR_LINES]), 0.0)


def _finds_cuda_headers(nvcc: Path, extra_flags: tuple[str, ...]) -> bool:
    """Whether `nvcc` (with the caller's flags) preprocesses a file that includes the CUDA runtime and fp16 headers:
    the one way to ask its own include path, profile and all. Asked only after a build failed, to say why."""
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch) / "probe.cu"
        probe.write_text("#include <cuda_runtime.h>\n#include <cuda_fp16.h>\n")
        try:
            result = subprocess.run([str(nvcc), *extra_flags, "-E", str(probe), "-o", os.devnull],
                                    capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return result.returncode == 0


def _command(nvcc: Path, source: Path, arch: str, extra_flags: tuple[str, ...]) -> list[str]:
    compute = "compute_" + arch.removeprefix("sm_")
    return [str(nvcc), *FLAGS, f"-gencode=arch={compute},code={arch}", *extra_flags, str(source)]


def _pip_cuda_tools(name: str) -> list[Path]:
    """Program `name` from NVIDIA's CUDA 13 wheels, e.g. `nvidia-cuda-nvcc` (`nvidia/cu13/bin`; it shares
    `nvidia/cu13` with the runtime and CCCL wheels, which nvcc's own profile searches). The CUDA 12 wheels ship
    ptxas but no nvcc."""
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    return [Path(root) / "cu13" / "bin" / name for root in roots]


def _no_nvcc_reason() -> str:
    pinned = os.environ.get("FLASH_CATALOG_NVCC")
    if pinned == "":
        return ("cannot build the CUDA kernel: FLASH_CATALOG_NVCC is set empty (build nothing); "
                "unset it to look for nvcc")
    if pinned is not None:
        return (f"cannot build the CUDA kernel: FLASH_CATALOG_NVCC={pinned} is not an executable file; "
                "point it at nvcc or unset it")
    return ("cannot build the CUDA kernel: no nvcc found (looked at $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, "
            f"/usr/local/cuda/bin and the nvidia-cuda-nvcc package); {_FIX}")


def _failed(status: BuildStatus, detail: str) -> CudaBuild:
    return CudaBuild(status, None, None, detail, "", 0.0)


def _key(source: bytes, arch: str, flags: tuple[str, ...], version: str) -> str:
    digest = hashlib.sha256(source)
    digest.update("\0".join([arch, version, *FLAGS, *flags]).encode())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("FLASH_CATALOG_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "flash_catalog") / "cuda"


def _parse_arch(arch: str) -> tuple[int, int, str]:
    """(major, minor, suffix) of an nvcc real arch such as "sm_90a"; raises ValueError naming a malformed one."""
    match = _ARCH.fullmatch(arch)
    if match is None:
        raise ValueError(f"arch {arch!r} is not an nvcc real architecture; use e.g. 'sm_90a' or 'sm_80'")
    return int(match.group(1)), int(match.group(2)), match.group(3)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
