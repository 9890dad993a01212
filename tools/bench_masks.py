"""Masked attention on one GPU: the host's dense masked SDPA vs every form that qualifies, and the pick.

Cases: TiRex-like grouped variate attention (128 groups x 17, covariates do not see the target; B64 H4
D128, fp32 and bf16), 32 groups x 512 (B8 H8 D64, bf16), an LTX text cross-attention with key padding
(Sq 24576, Skv 256, 200 valid; B1 H32 D128 bf16) and a causal decoder mask (B1 H32 S4096 D128 bf16).
Each form is timed against the host with `triton.testing.do_bench` (median); accuracy is against an fp32
reference; the pick is what the catalog's own gate (`decide.decide`, paired CUDA-event timing) binds.

    python tools/bench_masks.py [--json bench_masks.json] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.binder import default_catalog  # noqa: E402
from flash_catalog.capture.calibration import attention_contender  # noqa: E402
from flash_catalog.capture.calls import AttentionCall  # noqa: E402
from flash_catalog.catalog.catalog import build_form  # noqa: E402
from flash_catalog.decide.decide import AttachClock, GateOptions, TimingCache, Trial, decide  # noqa: E402
from flash_catalog.plan.records import ShapeRecord  # noqa: E402
from flash_catalog.plan.environment import environment  # noqa: E402
from flash_catalog.decide.gate import measure_accuracy  # noqa: E402
from flash_catalog.capture.masks import describe_mask  # noqa: E402


def grouped_mask(groups: int, size: int, covariate_rule: bool, device) -> torch.Tensor:
    gid = torch.arange(groups * size, device=device) // size
    mask = gid[:, None] == gid[None, :]
    if covariate_rule:
        target = torch.arange(groups * size, device=device) % size == 0
        mask &= ~(~target[:, None] & target[None, :])
    return mask


def cases(device):
    def qkv(b, h, sq, skv, d, dtype):
        g = torch.Generator(device=device).manual_seed(0)
        return [torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g) for s in (sq, skv, skv)]

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        out.append((f"tirex 128x17 covariate rule {str(dtype)[6:]}", qkv(64, 4, 2176, 2176, 128, dtype),
                    grouped_mask(128, 17, True, device)))
    out.append(("32x512 groups bf16", qkv(8, 8, 16384, 16384, 64, torch.bfloat16),
                grouped_mask(32, 512, False, device)))
    pad = torch.zeros(1, 1, 1, 256, device=device, dtype=torch.bfloat16)
    pad[..., 200:] = -10000.0
    out.append(("ltx text key padding bf16", qkv(1, 32, 24576, 256, 128, torch.bfloat16), pad))
    causal = torch.ones(4096, 4096, device=device, dtype=torch.bool).tril()
    out.append(("causal decoder mask bf16", qkv(1, 32, 4096, 4096, 128, torch.bfloat16), causal))
    return out


def main() -> int:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench_masks.json")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_masks needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    specs = default_catalog().family("attention_core")
    forms = [build_form(s) for s in specs]
    rows = []
    for name, (q, k, v), mask in cases(device):
        if args.only and args.only not in name:
            continue
        info = describe_mask(mask)
        call = AttentionCall(q, k, v, mask, False, None, False, 0.0, "bhsd", info)
        host = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=(
                mask if mask.dtype == torch.bool else mask.float()))
            host_ms = triton.testing.do_bench(host, warmup=50, rep=500, return_mode="median")
            row = {"case": name, "q": list(q.shape), "mask": info.kind, "rule": info.group_rule,
                   "host_ms": host_ms, "host_cos": measure_accuracy(host(), ref).cosine, "forms": {}}
            print(f"{name}: mask {info.kind} rule {info.group_rule}, host {host_ms:.3f} ms", flush=True)
            for form in forms:
                rule = attention_contender(form, "bench", call).rule
                if rule is not None:
                    row["forms"][form.name] = {"refused": f"{form.name}: {rule}"}
                    continue
                runner = form.runner(call)
                acc = measure_accuracy(runner(call), ref)
                ms = triton.testing.do_bench(lambda: runner(call), warmup=50, rep=500, return_mode="median")
                row["forms"][form.name] = {"ms": ms, "ratio": host_ms / ms, "cos": acc.cosine,
                                           "err": acc.max_rel_err, "detail": runner.detail}
                print(f"  {form.name:17} {ms:9.3f} ms  {host_ms / ms:7.2f}x  cos {acc.cosine:.6f} "
                      f"err {acc.max_rel_err:.2e}  {runner.detail}", flush=True)
            record = ShapeRecord(call.shape_key().describe(), 1, "host")
            decide(Trial("bench", f"q={tuple(q.shape)}", device, host),
                   [attention_contender(f, "bench", call) for f in forms], GateOptions(), TimingCache(), AttachClock(),
                   record)
        timed = {n: f["ratio"] for n, f in row["forms"].items() if "ratio" in f}
        row["picked"] = record.form if record.outcome == "bound" else None
        row["pick_outcome"], row["pick_reason"] = record.outcome, record.reason
        row["fastest"] = max(timed, key=timed.get) if timed else None
        print(f"  binder: {record.outcome} {record.form} ({record.reason[:160]})", flush=True)
        rows.append(row)
        for f in forms:
            f.retain(set())
        del q, k, v, mask, ref
        torch.cuda.empty_cache()

    env = environment(device)
    print(f"\n{env['device_name']}  torch {env['torch']}  triton {env['triton']}")
    print(f"{'case':38} {'host ms':>9} {'flex':>16} {'grouped':>16} {'sdpa_dense':>16}  picked / fastest")
    for r in rows:
        cells = []
        for n in ("flex_blocksparse", "grouped_batch", "sdpa_dense"):
            f = r["forms"].get(n, {})
            cells.append(f"{f['ratio']:6.2f}x {f['ms']:7.3f}" if "ratio" in f else "refused")
        print(f"{r['case']:38} {r['host_ms']:9.3f} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}  "
              f"{r['picked']} / {r['fastest']}")
    Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
