"""Attach under diffusers' context parallelism: Wan 2.1 14B (real config, random weights) spread over the ranks of
one `torchrun`, host vs attached per denoising step.

Every rank builds the same model and inputs (tools/bench_model.py's builders and seeds). Rows, in order:
- `single_host`: the unparallelised model on each rank's own GPU; its output is the cosine reference of every row;
- `single_attached` (`--single-attach`): attached on one GPU, timed, detached (the speedup CP should keep);
- `cp_host`: after `enable_parallelism(ContextParallelConfig(ulysses_degree=U, ring_degree=R))`, U x R the world
  size (both above 1: diffusers' unified attention, Ulysses' all-to-all over U ranks, then a ring over R);
- `cp_attached`: `attach` on the parallel model (timed; every decision agreed across the ranks), then timed.
Then: the plans of all ranks compared (site records, byte for byte as JSON), detach, the output bit-equal to
`cp_host`'s and the state dict equal to its fingerprint before attach, on every rank. Each row: the median of
`--steps` timed steps after `--warmup`, the slowest rank's. Rank 0 prints the table and writes the JSON. A derived
line follows (`overhead` in the JSON, not timed on its own): how much the CP host step exceeds an even split of the
single-GPU step (collectives, imbalance), and cp_attached's speedup with that share taken off both sides.

    torchrun --nproc-per-node 2 tools/bench_cp.py --model wan720 --ulysses 2 [--single-attach]
        [--profile default] [--steps 3] [--warmup 1] [--json bench_cp_wan720.json]
    torchrun --nproc-per-node 2 tools/bench_cp.py --model wan720 --ring 2 --backend _native_cudnn
    torchrun --nproc-per-node 8 tools/bench_cp.py --model wan720 --frames 121 --ulysses 4 --ring 2
    torchrun --nproc-per-node 2 tools/bench_cp.py --tiny --device cpu --min-speedup 0 [--ring 2]   # smoke, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model as bm  # noqa: E402  (its import puts the repository on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flash_catalog import attach, detach  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan720", choices=("wan480", "wan720"))
    p.add_argument("--frames", type=int, default=None,
                   help="video frames, 4k+1 (default: the model's, 81); Wan's VAE makes (frames - 1) / 4 + 1 latent "
                        "frames")
    p.add_argument("--ulysses", type=int, default=None,
                   help="Ulysses degree (default: the world size over the ring degree)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: the world size over the Ulysses "
                                                         "degree); their product is the world size")
    p.add_argument("--backend", default=None,
                   help="diffusers attention backend (ring needs one whose forward op returns the log-sum-exp: "
                        "_native_cudnn or _native_flash; default: _native_flash with a ring, diffusers' own otherwise)")
    p.add_argument("--profile", default=None, help="flash_catalog profile (default: the catalog's default order)")
    p.add_argument("--min-speedup", type=float, default=None, help="0 forces binds (smoke runs)")
    p.add_argument("--single-attach", action="store_true", help="also attach and time on one GPU")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="2 layers, tiny dims (smoke test)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default: bench_cp_<model>.json")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    if args.device == "cpu":
        from flash_catalog.cpu_parallel import cpu_flash_attention, one_device_per_process

        one_device_per_process()  # diffusers divides by the accelerator count, 0 on a CPU machine
        cpu_flash_attention()  # `_native_flash` (ring attention's host) has no CPU kernel
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)  # before NCCL: its collectives (and all_gather_object) use the current device
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), device


def degrees(ulysses: int | None, ring: int | None, world: int) -> tuple[int, int]:
    """The (Ulysses, ring) degrees: as given, the missing one the world size over the other (both missing: Ulysses
    over every rank); their product must be the world size, so every rank holds one share of the sequence."""
    ring = ring or (world // ulysses if ulysses else 1)
    ulysses = ulysses or world // ring
    if ulysses * ring != world:
        raise SystemExit(f"--ulysses {ulysses} x --ring {ring} is not the world size {world}")
    return ulysses, ring


def wan_latent_frames(frames: int | None) -> int | None:
    """Wan's latent frame count for `frames` video frames (its VAE keeps the first frame and 1 in 4 after it)."""
    if frames is None:
        return None
    if frames % 4 != 1:
        raise SystemExit(f"--frames {frames}: Wan takes 4k+1 frames")
    return (frames - 1) // 4 + 1


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def timed_steps(model, inputs, device, warmup: int, steps: int) -> tuple[float, bm.Outputs]:
    """Median seconds per step over `steps` after `warmup`, the slowest rank's, and the last output."""
    out: bm.Outputs = ()
    for _ in range(warmup):
        _, out = bm.call(model, inputs, device)
    times = []
    for _ in range(steps):
        seconds, out = bm.call(model, inputs, device)
        times.append(seconds)
    return max(gather(statistics.median(times))), out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = setup(args)
    ulysses, ring = degrees(args.ulysses, args.ring, world)
    backend = args.backend or ("_native_flash" if ring > 1 else None)
    say = bm.log if rank == 0 else (lambda message: None)
    from diffusers import ContextParallelConfig

    say(f"building {args.model}{' (tiny)' if args.tiny else ''} on {world} ranks, Ulysses {ulysses} x ring {ring}")
    model, inputs, tokens = bm.build(args.model, args.tiny, device, args.seed, "pretrained",
                                     wan_latent_frames(args.frames))
    if backend is not None:
        model.set_attention_backend(backend)
    rows: dict[str, dict[str, Any]] = {}

    seconds, reference = timed_steps(model, inputs, device, args.warmup, args.steps)
    rows["single_host"] = {"ms": seconds * 1e3, "cosine": 1.0}
    say(f"single_host {seconds * 1e3:.1f} ms")
    if args.single_attach:
        started = time.perf_counter()
        plan = attach(model, inputs, profile=args.profile, min_speedup=args.min_speedup)
        attach_s = max(gather(time.perf_counter() - started))
        seconds, out = timed_steps(model, inputs, device, args.warmup, args.steps)
        rows["single_attached"] = {"ms": seconds * 1e3, "cosine": min(gather(bm.cosine(out, reference))),
                                   "attach_s": attach_s, "counts": plan.counts()}
        detach(plan)
        say(f"single_attached {seconds * 1e3:.1f} ms, attach {attach_s:.1f} s")

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    seconds, host_out = timed_steps(model, inputs, device, args.warmup, args.steps)
    rows["cp_host"] = {"ms": seconds * 1e3, "cosine": min(gather(bm.cosine(host_out, reference)))}
    say(f"cp_host {seconds * 1e3:.1f} ms")
    before = bm.fingerprint(model)
    bm.sync(device)
    started = time.perf_counter()
    plan = attach(model, inputs, profile=args.profile, min_speedup=args.min_speedup)
    attach_s = max(gather(time.perf_counter() - started))
    say(f"attach {attach_s:.1f} s\n{plan}")
    seconds, out = timed_steps(model, inputs, device, args.warmup, args.steps)
    rows["cp_attached"] = {"ms": seconds * 1e3, "cosine": min(gather(bm.cosine(out, reference))),
                           "attach_s": attach_s, "counts": plan.counts(), "fallbacks": sum(plan.fallbacks.values())}
    say(f"cp_attached {seconds * 1e3:.1f} ms")
    sites = json.dumps([s.to_dict() for s in plan.sites], sort_keys=True, default=str)
    plans_identical = len(set(gather(sites))) == 1
    record = plan.to_dict()
    detach(plan)
    _, after = bm.call(model, inputs, device)
    exact = all(gather(bool(bm.equal(after, host_out)) and not bm.fingerprint_mismatches(before,
                                                                                          bm.fingerprint(model))))
    for name in rows:
        base = rows["cp_host" if name.startswith("cp_") else "single_host"]["ms"]
        rows[name]["speedup"] = base / rows[name]["ms"]
    overhead = parallel_overhead(rows, world)
    result = {"header": {"model": args.model, "tiny": args.tiny, "frames": args.frames, "tokens": tokens,
                         "world_size": world, "ulysses_degree": ulysses, "ring_degree": ring,
                         "backend": backend, "profile": args.profile,
                         "min_speedup": args.min_speedup, "steps": args.steps, "warmup": args.warmup,
                         "command": f"torchrun --nproc-per-node {world} " + " ".join(sys.argv),
                         "environment": bm.environment(device)},
              "rows": rows, "overhead": overhead, "plans_identical": plans_identical, "detach_exact": exact,
              "plan": record}
    if rank == 0:
        frames = f"_{args.frames}f" if args.frames else ""
        path = Path(args.json or f"bench_cp_{args.model}{frames}{'_tiny' if args.tiny else ''}.json")
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print_table(result)
        say(f"wrote {path}")
    dist.destroy_process_group()
    return 0 if plans_identical and exact else 1


def parallel_overhead(rows: dict[str, dict[str, Any]], world: int) -> dict[str, float]:
    """Derived, not timed on its own: what the CP host step adds to an even split of the single-GPU step (the
    collectives, and any imbalance), and the attached CP step's speedup over the CP host once that share, which no
    form touches, is taken off both. Compare the latter with `single_attached`'s speedup."""
    ms = rows["cp_host"]["ms"] - rows["single_host"]["ms"] / world
    return {"ms": ms, "speedup_without": (rows["cp_host"]["ms"] - ms) / (rows["cp_attached"]["ms"] - ms)}


def print_table(result: dict[str, Any]) -> None:
    h = result["header"]
    print(f"\n{h['model']}{' tiny' if h['tiny'] else ''}: {h['tokens']} video tokens, {h['world_size']} ranks, "
          f"Ulysses {h['ulysses_degree']} x ring {h['ring_degree']}, backend {h['backend'] or 'default'}, "
          f"profile {h['profile'] or 'default'}")
    print(f"{'row':16} {'ms/step':>10} {'speedup':>8} {'cosine':>9} {'attach s':>9}  bound")
    for name, row in result["rows"].items():
        attach_s = f"{row['attach_s']:.1f}" if "attach_s" in row else "-"
        bound = row.get("counts", {}).get("bound", "-")
        print(f"{name:16} {row['ms']:10.1f} {row['speedup']:8.3f} {row['cosine']:9.5f} {attach_s:>9}  {bound}")
    o = result["overhead"]
    print(f"derived: the CP host step exceeds the single-GPU step / {h['world_size']} by {o['ms']:.1f} ms "
          f"(collectives, imbalance); without it on both sides cp_attached is {o['speedup_without']:.3f}x")
    print(f"plans identical on every rank: {result['plans_identical']}; detach exact on every rank: "
          f"{result['detach_exact']}")


if __name__ == "__main__":
    sys.exit(main())
