"""Attention sites at LTX-2 size on one GPU: host dispatch vs `sdpa_dense`, and what the binder decides.

Two real diffusers `LTX2Attention` modules with random weights at real dims (dim 4096, 32 heads x 128):
a video self-attention site (S=24576, no mask) and a text cross-attention site (Sq=24576, Skv=256) that
receives LTX's all-pass additive mask. Each site is attached through `flash_catalog.attach` (its own
gate decides; the table's last column names the bound form and the gate's ratio), then the attention call
itself is timed side by side with `triton.testing.do_bench` (median), host dispatch vs an `sdpa_dense` runner,
with accuracy against an fp32 reference.

    python tools/bench_attention.py [--seq 24576] [--text 256] [--json bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.plan.environment import environment  # noqa: E402
from flash_catalog.forms.sdpa_dense import SdpaDense  # noqa: E402
from flash_catalog.binder import default_catalog  # noqa: E402
from flash_catalog.capture.calls import AttentionCall  # noqa: E402
from flash_catalog.decide.gate import measure_accuracy  # noqa: E402
from flash_catalog.capture.masks import describe_mask  # noqa: E402


class Site(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, hidden, context=None, mask=None):
        return self.attn(hidden, encoder_hidden_states=context, attention_mask=mask)


def make_attention(dim: int, heads: int, cross_dim: int | None, device, dtype):
    from diffusers.models.transformers.transformer_ltx2 import LTX2Attention

    attn = LTX2Attention(query_dim=dim, heads=heads, kv_heads=heads, dim_head=dim // heads, bias=True,
                         cross_attention_dim=cross_dim, out_bias=True, qk_norm="rms_norm_across_heads",
                         apply_gated_attention=True)
    return Site(attn).to(device=device, dtype=dtype).eval()


def bench_site(label: str, site: Site, kwargs: dict, flops: float) -> dict:
    import triton.testing

    from diffusers.models import attention_dispatch

    captured: dict = {}
    original = attention_dispatch.dispatch_attention_fn
    module_globals = type(site.attn.processor).__call__.__globals__

    def spy(*args, **kw):
        captured.setdefault("args", (args, kw))
        return original(*args, **kw)

    module_globals["dispatch_attention_fn"] = spy
    try:
        with torch.no_grad():
            site(**kwargs)
    finally:
        module_globals["dispatch_attention_fn"] = original
    args, kw = captured["args"]
    q, k, v = args[:3]
    mask = kw.get("attn_mask")

    plan = attach(site, kwargs)
    record = plan.sites[0].shapes[0]
    print(plan, flush=True)

    call = AttentionCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, False, None, False,
                         0.0, "bshd", describe_mask(mask))
    form = SdpaDense(next(s for s in default_catalog().specs if s.name == "sdpa_dense"))
    runner = form.runner(call)
    with torch.no_grad():
        host_fn = lambda: original(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)  # noqa: E731
        form_fn = lambda: call.to_host_layout(runner(call))  # noqa: E731
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() for t in (q, k, v)),
            attn_mask=None if mask is None else mask.float()).transpose(1, 2)
        host_acc = measure_accuracy(host_fn(), ref)
        form_acc = measure_accuracy(form_fn(), ref)
        host_ms = triton.testing.do_bench(host_fn, warmup=100, rep=1000, return_mode="median")
        form_ms = triton.testing.do_bench(form_fn, warmup=100, rep=1000, return_mode="median")
        host_ms2 = triton.testing.do_bench(host_fn, warmup=100, rep=1000, return_mode="median")
        module_host = triton.testing.do_bench(lambda: site(**kwargs), warmup=20, rep=500, return_mode="median")
    detach(plan)
    with torch.no_grad():
        module_detached = triton.testing.do_bench(lambda: site(**kwargs), warmup=20, rep=500,
                                                  return_mode="median")
    host_med = (host_ms + host_ms2) / 2
    return {
        "site": label, "q": list(q.shape), "k": list(k.shape), "mask": call.mask_kind,
        "host_ms": host_med, "host_ms_runs": [host_ms, host_ms2], "form_ms": form_ms,
        "host_tflops": flops / host_med / 1e9, "form_tflops": flops / form_ms / 1e9,
        "ratio": host_med / form_ms, "form_detail": runner.detail,
        "host_cos": host_acc.cosine, "host_err": host_acc.max_rel_err,
        "form_cos": form_acc.cosine, "form_err": form_acc.max_rel_err,
        "decision": record.outcome, "decision_form": record.form, "decision_speedup": record.speedup,
        "decision_reason": record.reason,
        "module_attached_ms": module_host, "module_detached_ms": module_detached,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=24576, help="video tokens (default 24576)")
    parser.add_argument("--text", type=int, default=256, help="text tokens (default 256)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", default="bench_attention.json", help="where to write the results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    dim = args.heads * args.head_dim
    hidden = torch.randn(1, args.seq, dim, device=device, dtype=dtype)
    text = torch.randn(1, args.text, dim, device=device, dtype=dtype)
    mask = torch.zeros(1, 1, args.text, device=device, dtype=dtype)  # LTX: (1 - ones) * -10000 = all zeros

    rows = []
    self_site = make_attention(dim, args.heads, None, device, dtype)
    rows.append(bench_site("video self-attention", self_site, {"hidden": hidden},
                           4.0 * args.heads * args.seq * args.seq * args.head_dim))
    del self_site
    cross_site = make_attention(dim, args.heads, dim, device, dtype)
    rows.append(bench_site("text cross-attention (all-pass additive mask)", cross_site,
                           {"hidden": hidden, "context": text, "mask": mask},
                           4.0 * args.heads * args.seq * args.text * args.head_dim))

    env = environment(device)
    print(f"\n{env['device_name']}  torch {env['torch']}  triton {env['triton']}  diffusers {env['diffusers']}")
    header = (f"{'site':46} {'q':>18} {'k':>18} {'host ms':>8} {'sdpa ms':>8} {'host TF':>8} {'sdpa TF':>8} "
              f"{'ratio':>6} {'sdpa cos':>9} {'sdpa err':>9} decision (gate)")
    print(header)
    for r in rows:
        print(f"{r['site']:46} {str(tuple(r['q'])):>18} {str(tuple(r['k'])):>18} {r['host_ms']:8.3f} "
              f"{r['form_ms']:8.3f} {r['host_tflops']:8.1f} {r['form_tflops']:8.1f} {r['ratio']:6.3f} "
              f"{r['form_cos']:9.6f} {r['form_err']:9.2e} {r['decision']} {r['decision_form'] or ''} "
              f"({'-' if r['decision_speedup'] is None else format(r['decision_speedup'], '.3f')}x)")
    Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
