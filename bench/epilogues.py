"""User-written fused epilogues on one GPU (2 virtual ranks).

    python3 bench/epilogues.py [--out outputs/epilogues.json]      # 1 GPU, a few minutes

Three tables, at hidden 4096 and 8192, batch 1 to 64 (bfloat16), and hidden 8192 at batch
256 and 1024 (4 and 16 MiB: past the one-shot kernel) for the user epilogues:

* ``user`` -- add + RMSNorm + FP8 (e4m3, a float32 scale per token) and bias + GELU fused
  into the all-reduce (``fused_us``) against the same all-reduce and then the same in
  separate PyTorch ops (``unfused_us``); ``kernel`` says what ran: the one-shot kernel with
  the epilogue inside, or (the large batches, bound with ``strategy="auto"``) the
  all-reduce's own kernel and then the epilogue kernel;
* ``wire`` -- FP8 on the wire: the prologue ``x / scale`` sent as e4m3fn or e5m2 and
  ``v * scale`` after the float32 sum (``wire_us``), against the same epilogue with bfloat16
  on the wire (``plain_us``), on the one-shot kernel; ``wire_err``: its largest error against
  the exact sum.

Each time: a CUDA graph of ``--ops`` calls, per call, median of ``--replays``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from purlin.bench.scripts import gpu_env, output, run_info, write_json

gpu_env()

EPS = 1e-6


def fp8_setup(hidden: int):
    """add + RMSNorm + e4m3 with a per-token scale: (epilogue, unfused) per rank."""
    import torch

    import purlin
    from purlin.bench.epilogues import fp8_norm

    stat, finish, quantise = fp8_norm(hidden, EPS)

    def setup(rank, count, device):
        residual = torch.randn(count, device=device).bfloat16()
        weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
        q = torch.empty(count, device=device, dtype=torch.float8_e4m3fn)
        scales = torch.empty(count // hidden, device=device)
        epi = purlin.Epilogue(quantise, extras=(weight,), residual=residual, stat=stat,
                              finish=finish, out=q, row_out=scales, hidden=hidden)
        r2 = residual.clone()

        def unfused(out):
            r2.add_(out)
            n = torch.rms_norm(r2.view(-1, hidden).float(), (hidden,), weight.float(), EPS)
            s = (n.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
            q.copy_((n / s).to(torch.float8_e4m3fn).view(-1))
            scales.copy_(s.view(-1))

        return epi, unfused

    return setup


def gelu_setup(hidden: int):
    import numpy as np
    import torch
    from numba import cuda

    import purlin

    @cuda.jit(device=True)
    def bias_gelu(v, bias):
        x = v + bias
        return np.float32(0.5) * x * (np.float32(1) + math.erf(x * np.float32(0.70710678)))

    def setup(rank, count, device):
        bias = torch.randn(hidden, device=device).bfloat16()

        def unfused(out):
            out.copy_(torch.nn.functional.gelu(out.view(-1, hidden) + bias).view(-1))

        return purlin.Epilogue(bias_gelu, extras=(bias,), hidden=hidden), unfused

    return setup


def wire_records(hiddens, batches, timing) -> list[dict]:
    """:func:`purlin.bench.epilogues.fp8_wire` for both FP8 wires on every shape."""
    from purlin.bench.epilogues import fp8_wire

    return [fp8_wire(hidden=h, batch=b, wire=w, **timing)
            for w in ("float8_e4m3fn", "float8_e5m2") for h in hiddens for b in batches]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--large-batch", type=int, nargs="*", default=[256, 1024],
                   help="batches at hidden 8192 bound with strategy='auto' (user epilogues)")
    p.add_argument("--ops", type=int, default=20)
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    from purlin.bench.clusters import gpu_count
    from purlin.bench.epilogues import fused_vs_unfused, table

    if not gpu_count():
        print("bench/epilogues.py needs a GPU (its ranks are virtual ranks on one)")
        return 2
    timing = {"ops": args.ops, "replays": args.replays}
    started = time.monotonic()
    user = []
    for hidden in args.hidden:
        for batch in args.batch:
            for name, setup in (("add_rms_norm_fp8", fp8_setup), ("bias_gelu", gelu_setup)):
                user.append(fused_vs_unfused(name, setup(hidden), hidden=hidden, batch=batch,
                                             **timing))
    for batch in args.large_batch:
        for name, setup in (("add_rms_norm_fp8", fp8_setup), ("bias_gelu", gelu_setup)):
            user.append(fused_vs_unfused(name, setup(8192), hidden=8192, batch=batch,
                                         strategy="auto", **timing))
    print("user epilogues fused vs the all-reduce + PyTorch ops (us per call)")
    print(table(user, ["epilogue", "hidden", "batch", "fused_us", "unfused_us", "speedup",
                       "kernel"]))
    wire = wire_records(args.hidden, args.batch, timing)
    print("\nFP8 on the wire vs bfloat16 on the wire, all-reduce + epilogue (us per call)")
    print(table(wire, ["wire", "hidden", "batch", "wire_us", "plain_us", "speedup", "wire_err",
                       "rel_err"]))
    path = write_json(output(args.out, "epilogues.json"), {
        "user": user, "wire": wire,
        "info": run_info("sm", time.monotonic() - started, kind="virtual", ranks=2,
                         hidden=args.hidden, batch=args.batch, large_batch=args.large_batch,
                         dtype="bfloat16", **timing)})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
