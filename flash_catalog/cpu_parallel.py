"""Running diffusers' context parallelism in CPU processes over gloo: for the tests and the CPU smoke run of
`tools/bench_cp.py`, never for a real run. Call both before building the model, in each worker process only."""

from __future__ import annotations

import torch

_HELD: list[torch.library.Library] = []  # the CPU kernel registration lives as long as the process


def one_device_per_process() -> None:
    """diffusers places each rank on `torch.device(accelerator, rank % torch.accelerator.device_count())`; a CPU-only
    machine reports 0 devices (a division by zero). Each CPU worker process is one "device"."""
    torch.accelerator.device_count = lambda *args: 1


def cpu_flash_attention() -> None:
    """diffusers' ring attention needs a backend whose forward op returns the log-sum-exp (its `native` one refuses);
    `_native_flash` calls `aten._scaled_dot_product_flash_attention`, which has no CPU kernel. Register one from
    torch's CPU flash kernel, which returns the same (output, log-sum-exp)."""
    if _HELD:
        return

    def flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p,
                                                                              is_causal, scale=scale)
        empty = torch.empty(0)
        return out, lse, empty, empty, query.shape[2], key.shape[2], empty, empty, empty

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", flash_cpu, "CPU")
    _HELD.append(lib)
