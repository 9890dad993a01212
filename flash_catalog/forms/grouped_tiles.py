"""`grouped_tiles`: a block-diagonal mask of contiguous groups served by a Triton tile kernel.

Each query tile (BLOCK_M rows, whole or partial groups) visits only the key rows of the groups it touches;
the in-group rule (none, causal, covariate/target) is applied inside the tile. Ragged groups and group
boundaries that differ per batch row are served. The per-structure tables (group codes, per-tile key ranges)
are built once per shape on the call's device. On CUDA the tile configuration is chosen by measuring a few
candidates; on CPU (Triton's interpreter, for tests) one small configuration is used.
"""

from __future__ import annotations

import functools

import torch

from ..capture.calls import AttentionCall
from ..capture.layout import output_layout
from ..decide.gate import median_seconds
from ..kernels.grouped_attention import (MAX_HEAD_DIM, RULES, GroupPlan, build_plan, candidate_configs,
                                         grouped_attention, interpreter_active, tma_eligible)
from .base import AttentionForm, Runner

CPU_CONFIG = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False, "warp_specialize": False,
              "fast_exp": "off"}
REPEATS = 5
FP32_PRECISION = "tf32x3"  # fp32 hosts: three TF32 products per dot, fp32-level error (Triton's default is TF32)


def _run(plan: GroupPlan, cfg: dict, call: AttentionCall) -> torch.Tensor:
    return grouped_attention(call.query, call.key, call.value, plan, scale=call.scale, num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"], tma=cfg["tma"], warp_specialize=cfg["warp_specialize"],
                             fast_exp=cfg["fast_exp"], fp32_precision=FP32_PRECISION,
                             out_layout=output_layout(call.layout, call.query))


def _describe(plan: GroupPlan, cfg: dict, call: AttentionCall) -> str:
    text = f"{plan.describe()}, {cfg['num_warps']} warps, {cfg['num_stages']} stages"
    if cfg["tma"] and tma_eligible(call.query, call.key, call.value):
        text += ", TMA"
    if cfg["warp_specialize"]:
        text += ", warp-specialised"
    if cfg["fast_exp"] != "off" and call.query.dtype != torch.float32:
        text += f", exp2 {cfg['fast_exp']}"
    if call.query.dtype == torch.float32:
        text += f", fp32 {FP32_PRECISION}"
    return text


def _mean_group(call: AttentionCall) -> float:
    offsets = call.mask.offsets or ()
    groups = sum(len(o) - 1 for o in offsets) / max(len(offsets), 1)
    return call.query.shape[2] / max(groups, 1)


class GroupedTiles(AttentionForm):
    def rule(self, call: AttentionCall) -> str | None:
        info = call.mask
        q, k, v = call.query, call.key, call.value
        if call.is_causal:
            return "is_causal with a mask is not served"
        if q.device.type not in ("cuda", "cpu"):
            return f"device {q.device.type} not served"
        if q.device.type == "cpu" and not interpreter_active():
            return "CPU only through Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)"
        if info.offsets is None:
            return "no group boundaries in the mask description"
        if info.group_rule not in RULES:
            return f"in-group rule {info.group_rule} not served"
        if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
            return "query and key lengths differ"
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            return "key/value batch differs from the query's"
        if len(info.offsets) not in (1, q.shape[0]):
            return f"group boundaries for {len(info.offsets)} batch rows, the call has {q.shape[0]}"
        if k.shape[1] != v.shape[1] or (k.shape[1] != q.shape[1]
                                        and (not call.enable_gqa or q.shape[1] % k.shape[1])):
            return f"heads q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]} not served"
        if call.scale is not None and not call.scale > 0:
            return f"scale {call.scale} <= 0"
        if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
            return f"head_dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
        if info.empty_rows and (call.attn_mask is None or call.attn_mask.dtype != torch.bool):
            return "rows with no allowed key under an additive mask (the host averages them, this form gives zeros)"
        return None

    def build(self, call: AttentionCall) -> Runner:
        info = call.mask
        device = call.query.device
        seq = call.query.shape[2]
        plan_for = functools.cache(lambda bm, bn: build_plan(
            info.offsets, info.group_rule, seq, covariate_rows=info.covariate_rows, target_cols=info.target_cols,
            block_m=bm, block_n=bn, device=device))
        if device.type != "cuda":
            plan = plan_for(CPU_CONFIG["block_m"], CPU_CONFIG["block_n"])
            return Runner(functools.partial(_run, plan, CPU_CONFIG), _describe(plan, CPU_CONFIG, call))
        best: tuple[float, Runner] | None = None
        failures = []
        for cfg in candidate_configs(call.query.shape[-1], _mean_group(call), call.query.dtype):
            plan = plan_for(cfg["block_m"], cfg["block_n"])
            run = functools.partial(_run, plan, cfg)
            try:  # several calls per sample: steady-state time, host-side launch cost overlapped as in a model
                seconds = median_seconds(lambda: [run(call) for _ in range(REPEATS)], device, samples=3)
            except Exception as exc:  # this configuration does not compile or fit here (shared memory)
                failures.append(f"{cfg}: {type(exc).__name__}")
                seconds = float("inf")
            seconds = self.agreement.slowest(seconds)  # every rank of a context-parallel model picks the same
            if seconds == float("inf"):
                continue
            if best is None or seconds < best[0]:
                best = (seconds, Runner(run, _describe(plan, cfg, call)))
        if best is None:
            raise RuntimeError(f"{self.name}: no tile configuration runs here ({'; '.join(failures)})")
        return best[1]
