"""grouped_tiles on one GPU: the Triton group-tile kernel against the host's dense masked SDPA.

Cases (bool (S, S) mask, as the hosts pass it):
  tirex     B64 H4 S2176 D128 bf16, 128 groups of 17, covariates do not see the target (TiRex-2)
  tirex32   the same in float32 (fp32 products: ieee, tf32x3, tf32)
  g512      B8 H8 S16384 D64 bf16, 32 groups of 512, no in-group rule
  ragged    B8 H8 S16384 D64 bf16, ragged groups (sizes 1..1024), causal inside groups (kernel only)

Each variant (tile configuration, fp32 precision; `form` = what GroupedTiles.build picks by measurement;
`flex` = the flex_blocksparse form, with --flex) is timed with triton.testing.do_bench (median), and its
accuracy is the cosine and max |out - ref| / max |ref| against an fp32 reference computed group by group.

    python tools/bench_grouped_tiles.py [--cases tirex,g512] [--sweep] [--flex] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.capture.calls import AttentionCall  # noqa: E402
from flash_catalog.catalog.catalog import Catalog, build_form  # noqa: E402
from flash_catalog.kernels.grouped_attention import (build_plan, candidate_configs,  # noqa: E402
                                                     grouped_attention)
from flash_catalog.capture.masks import describe_mask  # noqa: E402

def _cfg(m, n, w, st, tma=False, ws=False, fx="off"):
    return {"block_m": m, "block_n": n, "num_warps": w, "num_stages": st, "tma": tma, "warp_specialize": ws,
            "fast_exp": fx}


# --sweep: extra tile configurations per case (besides candidate_configs, which the form measures itself).
SWEEP = {
    "tirex": [_cfg(64, 16, 4, 2), _cfg(64, 32, 4, 3, True), _cfg(64, 32, 4, 2, True, fx="f16x2"),
              _cfg(32, 32, 4, 2, True), _cfg(128, 32, 8, 2, True)],
    "g512": [_cfg(128, 64, 4, 2, True), _cfg(128, 128, 4, 2, True), _cfg(128, 128, 8, 2, True),
             _cfg(128, 32, 4, 3, True), _cfg(128, 64, 4, 3, fx="f16x2"), _cfg(128, 64, 8, 2, True, True),
             _cfg(64, 64, 4, 3, True), _cfg(256, 128, 8, 2, True)],
    "tirex32": [_cfg(64, 32, 4, 2), _cfg(64, 16, 4, 2)],
    "ragged": [_cfg(128, 64, 4, 3, True, fx="f16x2"), _cfg(128, 128, 8, 2, True)],
}


def offsets_of(sizes):
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def make_case(name: str, device):
    g = torch.Generator(device=device).manual_seed(0)
    if name in ("tirex", "tirex32"):
        b, h, d, sizes, rule = 64, 4, 128, [17] * 128, "covariate_target"
        dtype = torch.float32 if name == "tirex32" else torch.bfloat16
    elif name == "g512":
        b, h, d, sizes, rule, dtype = 8, 8, 64, [512] * 32, "none", torch.bfloat16
    elif name == "ragged":
        gen = torch.Generator().manual_seed(1)
        sizes, total = [], 0
        while total < 16384:
            s = min(int(torch.randint(1, 1025, (1,), generator=gen)), 16384 - total)
            sizes.append(s)
            total += s
        b, h, d, rule, dtype = 8, 8, 64, "causal", torch.bfloat16
    else:
        raise SystemExit(f"unknown case {name}")
    s = sum(sizes)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g) for _ in range(3))
    offs = offsets_of(sizes)
    gid = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
    mask = gid[:, None] == gid[None, :]
    target = torch.zeros(s, dtype=torch.bool, device=device)
    target[torch.tensor(offs[:-1], device=device)] = True
    if rule == "covariate_target":
        mask &= ~(~target[:, None] & target[None, :])
    elif rule == "causal":
        mask = mask.tril()
    return dict(q=q, k=k, v=v, mask=mask, sizes=sizes, rule=rule, offsets=offs,
                cov=tuple((~target).tolist()), tgt=tuple(target.tolist()))


def reference(c) -> torch.Tensor:
    """fp32 attention group by group (groups of one size batched together)."""
    q, k, v = (t.float() for t in (c["q"], c["k"], c["v"]))
    out = torch.empty_like(q)
    offs = c["offsets"]
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(c["sizes"]):
        by_size.setdefault(n, []).append(offs[i])
    for n, starts in by_size.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        start = starts[0]
        local = c["mask"][start:start + n, start:start + n]
        sub = [t[:, :, idx].unflatten(2, (len(starts), n)).transpose(1, 2).flatten(0, 1) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*sub, attn_mask=local)
        out[:, :, idx] = o.unflatten(0, (q.shape[0], len(starts))).transpose(1, 2).flatten(2, 3)
    return out


def accuracy(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    return float(a @ b / (a.norm() * b.norm())), float((a - b).abs().max() / b.abs().max())


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def figures(name, c):
    q = c["q"]
    b, h, s, d = q.shape
    scores = b * h * sum(n * n for n in c["sizes"])
    if c["rule"] == "causal":
        scores = b * h * sum(n * (n + 1) // 2 for n in c["sizes"])
    bytes_ = 4 * q.numel() * q.element_size()
    return {"useful_tflop": 4 * scores * d / 1e12, "io_mb": bytes_ / 1e6,
            "io_floor_ms_at_4.3TBps": bytes_ / 4.3e12 * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="tirex,g512,tirex32")
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP tile list too")
    ap.add_argument("--flex", action="store_true", help="time the flex_blocksparse form too (compiles)")
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    specs = {s.name: s for s in Catalog.load().specs}
    rows = []
    for name in args.cases.split(","):
        c = make_case(name, device)
        q, k, v, mask = c["q"], c["k"], c["v"], c["mask"]
        ref = reference(c)
        fig = figures(name, c)
        print(f"\n## {name}: q={tuple(q.shape)} {str(q.dtype)[6:]} {len(c['sizes'])} groups, rule {c['rule']}; "
              f"useful {fig['useful_tflop'] * 1e3:.1f} GFLOP, q+k+v+o {fig['io_mb']:.0f} MB "
              f"({fig['io_floor_ms_at_4.3TBps']:.3f} ms at 4.3 TB/s)")
        print(f"{'variant':58s} {'ms':>8s} {'speedup':>8s} {'cos':>10s} {'rel_err':>9s}")
        host_ms = None

        def emit(variant, fn, detail=""):
            nonlocal host_ms
            try:
                out = fn()
                torch.cuda.synchronize()
                ms = bench(fn)
            except Exception as exc:  # a config that does not compile or fit
                print(f"{variant:58s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                rows.append({"case": name, "variant": variant, "error": f"{type(exc).__name__}: {exc}"[:500]})
                return
            cos, rel = accuracy(out, ref)
            if variant == "host":
                host_ms = ms
            speed = host_ms / ms if host_ms else float("nan")
            print(f"{variant:58s} {ms:8.4f} {speed:7.2f}x {cos:10.7f} {rel:9.2e} {detail}")
            rows.append({"case": name, "shape": list(q.shape), "dtype": str(q.dtype)[6:], "variant": variant,
                         "ms": ms, "speedup": speed, "cos": cos, "rel_err": rel, "detail": detail, **fig})

        if not args.no_host:
            emit("host", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        d = q.shape[-1]
        mean_group = q.shape[2] / len(c["sizes"])
        configs = candidate_configs(d, mean_group, q.dtype)
        if args.sweep:
            configs += [x for x in SWEEP.get(name, []) if x not in configs]
        precisions = ["tf32x3", "ieee", "tf32"] if q.dtype == torch.float32 else ["ieee"]
        plans = {}
        for cfg in configs:
            key = (cfg["block_m"], cfg["block_n"])
            if key not in plans:
                plans[key] = build_plan([c["offsets"]], c["rule"], q.shape[2], covariate_rows=[c["cov"]],
                                        target_cols=[c["tgt"]], block_m=key[0], block_n=key[1], device=device)
            plan = plans[key]
            for prec in precisions:
                variant = (f"kernel M{cfg['block_m']} N{cfg['block_n']} w{cfg['num_warps']} "
                           f"s{cfg['num_stages']}"
                           + (" tma" if cfg["tma"] else "") + (" ws" if cfg["warp_specialize"] else "")
                           + (f" exp={cfg['fast_exp']}" if cfg.get("fast_exp", "off") != "off" else "")
                           + (f" {prec}" if q.dtype == torch.float32 else ""))
                emit(variant, lambda plan=plan, cfg=cfg, prec=prec: grouped_attention(
                    q, k, v, plan, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], fp32_precision=prec,
                    tma=cfg["tma"], warp_specialize=cfg["warp_specialize"], fast_exp=cfg.get("fast_exp", "off")),
                    plan.describe())
        info = describe_mask(mask)
        call = AttentionCall(q, k, v, mask, False, None, False, 0.0, "bhsd", info)
        form = build_form(specs["grouped_tiles"])
        rule = form.rule(call)
        if rule:
            print(f"form: refused: {rule}")
        else:
            runner = form.build(call)
            emit("form grouped_tiles (its own pick)", lambda: runner(call), runner.detail)
        if args.flex:
            try:
                flex_runner = build_form(specs["flex_blocksparse"]).build(call)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"form flex_blocksparse: build failed: {type(exc).__name__}: {str(exc)[:120]}")
            else:
                emit("form flex_blocksparse", lambda: flex_runner(call), flex_runner.detail)
        del c, q, k, v, mask, ref
        torch.cuda.empty_cache()
        if args.json:  # after every case, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
