"""The quantized linears the feed-forward forms call, eager and under torch.compile.

* `w8a8_linear(x, w_q, w_scale, bias, scheme, activation, out_dtype)`: `activation(x) @ W.T + bias` with x
  quantized per row by `scheme`, "fp8" (e4m3 rows, `torch._scaled_mm`) or "int8" (INT8 rows, the Triton GEMM with
  the dequantisation in its epilogue); `activation` None, "gelu", "gelu_tanh" or "silu", applied to x first.
  Eager, the scheme's fused kernels run directly (no op dispatch). Traced, the row quantiser is torch expressions
  that inductor fuses into the op before it (a norm, a modulation, an activation), and the GEMM is
  `torch._scaled_mm` (FP8) or the op `flash_catalog::int8_matmul` (INT8: a `torch.library.triton_op`, whose Triton
  kernel inductor launches from its own code, without a Python launch's host time; an opaque custom op on a torch
  without `triton_op`); on sm_90, a GEMM of `PREPARED_MIN_ROWS` rows or more is `flash_catalog::int8_matmul_prepared`
  instead, the Triton or Gluon kernel measured fastest there by the GPU's time, launched by the op's body through
  its prepared launcher (`int8_gemm_choice`; `TRACED_INT8_ENV` chooses). There, a feed-forward's inner activation
  and its row quantiser are the op `flash_catalog::quantize_rows_int8` (the quantiser kernel's one pass over each
  row, which inductor's reduction makes in two), since its input is the up-projection's opaque output and nothing
  precedes it to fuse into; other rows keep the torch quantisers, fused into the op before them. The torch quantisers
  give the Triton kernels' bits; inductor's own code for them may round a division differently now and then.
* `flash_catalog::nvfp4_linear(x, w_codes, w_block_scale, w_global_scale, bias, out_dtype)`: the exact NVFP4
  emulation (`nvfp4.nvfp4_linear`) of a weight (N, K) given by its packed codes (N, K // 2), one opaque op.

Weights are tensor arguments, so modules of one architecture with different weights share one compiled graph. Each
op's fake implementation gives a fresh row-major (..., N) output, as every path returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .fp8_rowwise import fp8_linear, fp8_matmul, quantize_rows_fp8_torch
from .nvfp4 import NvFp4Tensor
from .nvfp4 import nvfp4_linear as nvfp4_emulated
from .rows import over_rows

if TYPE_CHECKING:
    from .int8_gemm_choice import PreparedGemm
    from .triton_launch import RepeatLaunch

W8A8_SCHEMES = ("fp8", "int8")

__all__ = ["w8a8_linear", "int8_matmul", "nvfp4_linear", "W8A8_SCHEMES"]


def _rows_out(x: torch.Tensor, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """What every linear here returns for x (..., K): a new contiguous (..., N) tensor of out_dtype."""
    return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


def w8a8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                activation: str | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`activation(x) @ W.T + bias`, x quantized per row by `scheme`; w_q, w_scale from that scheme's weight
    quantiser. Eager: the fused kernels; traced: the quantiser as torch ops before the GEMM (module docstring)."""
    if scheme not in W8A8_SCHEMES:
        raise ValueError(f"scheme is {scheme!r}; allowed: {', '.join(map(repr, W8A8_SCHEMES))}")
    if torch.compiler.is_compiling():
        return _traceable(x, w_q, w_scale, bias, scheme, activation, out_dtype)
    if scheme == "fp8":
        return fp8_linear(x, w_q, w_scale, bias, out_dtype, activation)
    from .int8_gemm import int8_linear  # the INT8 kernels need triton: imported where that scheme runs

    return int8_linear(x, w_q, w_scale, bias, out_dtype, activation)


def _traceable(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str,
               activation: str | None, out_dtype: torch.dtype) -> torch.Tensor:
    def product(x2: torch.Tensor) -> torch.Tensor:
        if scheme == "fp8":
            codes, scale = quantize_rows_fp8_torch(x2, activation)
            return fp8_matmul(codes, scale, w_q, w_scale, bias, out_dtype)
        from .int8_gemm import MAX_FUSED_ROW, quantize_rows_int8_torch

        prepared = _prepared_rows(x2.shape[0], w_q.device)
        if prepared and x2.shape[1] <= MAX_FUSED_ROW and activation is not None:
            # a feed-forward's inner activation: its input is the up-projection's output, an opaque op, so
            # inductor has nothing to fuse the quantiser into; the kernel's one pass over the row beats its two
            codes, scale = torch.ops.flash_catalog.quantize_rows_int8(x2, activation)
        elif activation is None:  # the torch quantiser as one node, for `cat_rows_rewrite` to find; then decomposed
            codes, scale = torch.ops.flash_catalog.quantize_rows_int8_fusable(x2)
        else:
            codes, scale = quantize_rows_int8_torch(x2, None, activation)
        if prepared:
            return torch.ops.flash_catalog.int8_matmul_prepared(codes, scale, w_q, w_scale, bias, out_dtype)
        return int8_matmul(codes, scale, w_q, w_scale, bias, out_dtype)

    return over_rows(x, w_q.shape[1], w_q.shape[0], out_dtype, product)


_GEMM_OP = getattr(torch.library, "triton_op", None) or torch.library.custom_op  # triton_op: torch >= 2.6


@_GEMM_OP("flash_catalog::int8_matmul", mutates_args=())
def int8_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`(a @ w.T exact in int32) * a_scale * w_scale + bias` (`int8_gemm.int8_matmul_traceable`): a (M, K) int8 row
    codes, a_scale (M, 1) fp32, w (N, K) int8, w_scale (N,) fp32. A `triton_op`: inductor sees its Triton kernel and
    launches it itself; its fake is the body run on fake tensors."""
    from .int8_gemm import int8_matmul_traceable

    return int8_matmul_traceable(a, a_scale, w, w_scale, bias, out_dtype)


if not hasattr(torch.library, "triton_op"):  # a custom op needs its fake; a triton_op runs its body on fakes
    @int8_matmul.register_fake
    def _(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype) -> torch.Tensor:
        return _rows_out(a, w.shape[0], out_dtype)


TRACED_INT8_ENV = "FLASH_CATALOG_TRACED_INT8"
"""Which ops a traced INT8 linear becomes, read when a graph is traced: "auto" (default: `int8_matmul_prepared` at
`PREPARED_MIN_ROWS` rows or more on a GPU the Gluon kernel serves, with `quantize_rows_int8` for a fused activation's
rows, else `int8_matmul` after torch quantisers), "grouped" ("auto", and linears that read the same rows through
weights laid side by side become one `int8_matmul_group`, `gemm_groups`: fewer launches, but a slower compiled
step where measured, so not the default) or "triton_op" (always `int8_matmul`, whose Triton kernel inductor
launches, after torch quantisers)."""
TRACED_INT8_POLICIES = ("auto", "grouped", "triton_op")
PREPARED_MIN_ROWS = 1024
"""Fewer rows than this keep the Triton op: the Gluon kernel's tiles gain nothing there (BENCHMARKS.md)."""


def _prepared_rows(m: object, device: torch.device) -> bool:
    """Whether a traced GEMM of `m` rows on `device` becomes `int8_matmul_prepared`."""
    if not isinstance(m, int) or m < PREPARED_MIN_ROWS or device.type != "cuda":
        return False
    return _gluon_traced(-1 if device.index is None else device.index)


def traced_int8_policy() -> str:
    """`TRACED_INT8_ENV`'s setting, checked: one of `TRACED_INT8_POLICIES`."""
    import os

    policy = os.environ.get(TRACED_INT8_ENV, "auto")
    if policy not in TRACED_INT8_POLICIES:
        raise ValueError(f"{TRACED_INT8_ENV}={policy!r}; allowed: {', '.join(map(repr, TRACED_INT8_POLICIES))}")
    return policy


@torch.compiler.assume_constant_result
def _gluon_traced(index: int) -> bool:
    """The policy (`TRACED_INT8_ENV`) and whether the Gluon kernel serves CUDA device `index` (-1: the current
    one): a constant to the tracer, which runs it once instead of tracing it."""
    if traced_int8_policy() == "triton_op" or not torch.cuda.is_available():
        return False
    try:
        from .int8_gemm_gluon import serves_device
    except ImportError:  # a triton without Gluon's Hopper dialect
        return False
    return serves_device(torch.device("cuda", torch.cuda.current_device() if index < 0 else index))


_LIB = torch.library.Library("flash_catalog", "FRAGMENT")
_LIB.define("int8_matmul_prepared(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? bias, "
            "ScalarType out_dtype) -> Tensor")
_PREPARED: dict[tuple, PreparedGemm | None] = {}  # operand layout -> its launch (None: the checked call serves it)


def _int8_matmul_prepared(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`int8_matmul`'s bits on the kernel `COMPILED_CHOICES` measured fastest at the shape (by the GPU's time),
    launched through its prepared launcher: the checks once per operand layout. Defined on a `Library` (no
    autograd layer): a few microseconds of dispatch where the compiled graph calls it."""
    # everything check_matmul and the kernel choice read: a call at a known key skips them
    key = (a.dtype, a.shape, a.stride(), a.data_ptr() % 16, a_scale.dtype, a_scale.shape, a_scale.stride(), w.dtype,
           w.shape, w.stride(), w.data_ptr() % 16, w_scale.dtype, w_scale.shape, w_scale.stride(),
           None if bias is None else (bias.dtype, bias.shape, bias.stride()), out_dtype, a.device)
    try:
        prepared = _PREPARED[key]
    except KeyError:
        from .int8_gemm import check_matmul, tma_blocker, triton_serves
        from .int8_gemm_choice import COMPILED_CHOICES, prepare_gemm

        check_matmul(a, a_scale, w, w_scale, bias, out_dtype)
        (m, k), n = a.shape, w.shape[0]
        # where int8_matmul itself would launch its kernel (not its torch path), on fresh row-major codes
        served = triton_serves(a.device) and min(m, n, k) > 0 and a.stride() == (k, 1) and a_scale.is_contiguous() \
            and tma_blocker(a=a) is None
        prepared = prepare_gemm(m, w, w_scale, bias, out_dtype, COMPILED_CHOICES) if served else None
        _remember(_PREPARED, key, prepared)
    if prepared is None:
        from .int8_gemm import int8_matmul as checked

        return checked(a, a_scale, w, w_scale, bias, out_dtype)
    return prepared(a, a_scale, w, w_scale, bias)


def _remember(store: dict, key: tuple, value: object, limit: int = 256) -> None:
    """Keep `value` under `key`, starting `store` afresh once it holds `limit` layouts."""
    if len(store) >= limit:
        store.clear()
    store[key] = value


def clear_prepared() -> None:
    """Forget the traced GEMMs', row quantisers' and concatenation quantisers' prepared launches (the choices stay
    in `COMPILED_CHOICES`)."""
    _PREPARED.clear()
    _QUANT_PREPARED.clear()
    _CAT_PREPARED.clear()


for _key_name in ("CUDA", "CPU"):  # CPU: the checked torch path (no kernel to prepare)
    _LIB.impl("int8_matmul_prepared", _int8_matmul_prepared, _key_name)


@torch.library.register_fake("flash_catalog::int8_matmul_prepared", lib=_LIB)
def _(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
      out_dtype: torch.dtype) -> torch.Tensor:
    return _rows_out(a, w.shape[0], out_dtype)


_LIB.define("int8_matmul_group(Tensor a, Tensor a_scale, Tensor[] w, Tensor[] w_scale, Tensor[] bias, "
            "ScalarType out_dtype) -> Tensor")


def _side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` without a copy where the parts are consecutive rows of one base tensor (as
    `forms/shared_weights` lays out the weights of projections that read one input); else the copy."""
    first, base = parts[0], parts[0]._base
    offset = first.storage_offset()
    for part in parts:
        if part._base is not base or base is None or part.shape[1:] != first.shape[1:] or not part.is_contiguous() \
                or part.storage_offset() != offset:
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _int8_matmul_group(a: torch.Tensor, a_scale: torch.Tensor, w: list[torch.Tensor], w_scale: list[torch.Tensor],
                       bias: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMMs of several weights over the same row codes as one, (M, sum of N): column j's block is
    `int8_matmul(a, a_scale, w[j], w_scale[j], bias[j])`, the same bits (each output element's integer dot product
    and epilogue are the same). One launch over the weights' shared buffer where they lie side by side in it
    (`gemm_groups` only groups such weights); weights elsewhere are concatenated first, slower but the same."""
    return _int8_matmul_prepared(a, a_scale, _side_by_side(w), _side_by_side(w_scale), _side_by_side(bias),
                                 out_dtype)


for _key_name in ("CUDA", "CPU"):
    _LIB.impl("int8_matmul_group", _int8_matmul_group, _key_name)


@torch.library.register_fake("flash_catalog::int8_matmul_group", lib=_LIB)
def _(a: torch.Tensor, a_scale: torch.Tensor, w: list[torch.Tensor], w_scale: list[torch.Tensor],
      bias: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _rows_out(a, sum(part.shape[0] for part in w), out_dtype)


_LIB.define("quantize_rows_int8(Tensor x, str? activation) -> (Tensor, Tensor)")


_QUANT_PREPARED: dict[tuple, RepeatLaunch | None] = {}  # rows' layout -> its launch (None: the checked call serves)


def _quantize_rows_int8(x: torch.Tensor, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`int8_gemm.quantize_rows_int8` (no smooth): the activation and the row's INT8 codes and scale in the
    quantiser kernel's one pass, the row held in registers, where it serves; else its torch path, the same bits.
    The checks and the launch's arguments once per rows' layout (a compiled graph calls it at one every step)."""
    key = (x.dtype, x.shape, x.stride(), x.data_ptr() % 16, x.device, activation)
    launch = _QUANT_PREPARED.get(key)
    if launch is None:
        from .int8_gemm import quantize_rows_int8, quantiser_serves, repeat_quant

        result = quantize_rows_int8(x, None, activation)  # its checks raise before anything is kept
        if key not in _QUANT_PREPARED:
            _remember(_QUANT_PREPARED, key,
                      repeat_quant(x, activation) if quantiser_serves(x) and x.shape[0] > 0 else None)
        return result
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    launch(x, x, codes, scale)
    return codes, scale


for _key_name in ("CUDA", "CPU"):
    _LIB.impl("quantize_rows_int8", _quantize_rows_int8, _key_name)


@torch.library.register_fake("flash_catalog::quantize_rows_int8", lib=_LIB)
def _(x: torch.Tensor, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


_LIB.define("quantize_rows_int8_fusable(Tensor x) -> (Tensor, Tensor)")


def _quantize_rows_int8_fusable(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int8_gemm.quantize_rows_int8_torch(x)`: the op's only kernel (CompositeImplicitAutograd), so AOT autograd
    decomposes it into the torch ops inductor fuses, unless `cat_rows_rewrite` replaced it first."""
    from .int8_gemm import quantize_rows_int8_torch

    return quantize_rows_int8_torch(x)


_LIB.impl("quantize_rows_int8_fusable", _quantize_rows_int8_fusable, "CompositeImplicitAutograd")

_LIB.define("quantize_cat_rows_int8(Tensor a, Tensor b, str? activation) -> (Tensor, Tensor)")


_CAT_PREPARED: dict[tuple, RepeatLaunch | None] = {}  # both parts' layout -> its launch (None: the checked call)


def _quantize_cat_rows_int8(a: torch.Tensor, b: torch.Tensor,
                            activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`cat_rows.quantize_cat_rows_int8`: the codes and scales of `cat([a, activation(b)], 1)`, one pass a row where
    the kernel serves, else the torch path (the same bits). The checks and the launch's arguments once per both
    parts' layout, as `_quantize_rows_int8` (a compiled Flux step calls it in every single-stream block)."""
    key = (a.dtype, a.shape, a.stride(), a.data_ptr() % 16, b.dtype, b.shape, b.stride(), b.data_ptr() % 16, a.device,
           b.device, activation)
    launch = _CAT_PREPARED.get(key)
    if launch is None:
        from .cat_rows import cat_quantiser_serves, quantize_cat_rows_int8, repeat_cat_quant

        result = quantize_cat_rows_int8(a, b, activation)  # its checks raise before anything is kept
        if key not in _CAT_PREPARED:
            _remember(_CAT_PREPARED, key,
                      repeat_cat_quant(a, b, activation) if cat_quantiser_serves(a, b) and a.shape[0] > 0 else None)
        return result
    codes = torch.empty((a.shape[0], a.shape[1] + b.shape[1]), dtype=torch.int8, device=a.device)
    scale = torch.empty((a.shape[0], 1), dtype=torch.float32, device=a.device)
    launch(a, b, codes, scale)
    return codes, scale


for _key_name in ("CUDA", "CPU"):
    _LIB.impl("quantize_cat_rows_int8", _quantize_cat_rows_int8, _key_name)


@torch.library.register_fake("flash_catalog::quantize_cat_rows_int8", lib=_LIB)
def _(a: torch.Tensor, b: torch.Tensor, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (a.new_empty((a.shape[0], a.shape[1] + b.shape[1]), dtype=torch.int8),
            a.new_empty((a.shape[0], 1), dtype=torch.float32))


@torch.library.custom_op("flash_catalog::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, w_codes: torch.Tensor, w_block_scale: torch.Tensor, w_global_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """W4A4 `x @ W.T + bias` by the exact emulation; the weight's parts as `quantize_nvfp4` made them."""
    n, half_k = w_codes.shape
    w = NvFp4Tensor(w_codes, w_block_scale, w_global_scale, (n, 2 * half_k))
    return nvfp4_emulated(x, w, bias, out_dtype, emulate=True)


@nvfp4_linear.register_fake
def _(x: torch.Tensor, w_codes: torch.Tensor, w_block_scale: torch.Tensor, w_global_scale: torch.Tensor,
      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _rows_out(x, w_codes.shape[0], out_dtype)
