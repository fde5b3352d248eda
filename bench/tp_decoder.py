"""A tensor-parallel Llama-style decoder layer, NCCL vs Purlin all-reduce, under CUDA graphs.

    python3 bench/tp_decoder.py [--out outputs/tp_decoder.json]       # 2 GPUs, ~1-2 minutes

One process per GPU (TP=2). Each rank holds its shard of a Llama-style layer with random bf16
weights: RMSNorm, attention (column-parallel fused QKV with grouped KV heads and rotary
embeddings, ``scaled_dot_product_attention`` over a KV cache of ``--kv`` tokens when decoding,
causal over the prompt when prefilling, row-parallel output projection) and a SwiGLU MLP
(column-parallel gate/up, row-parallel down) -- two all-reduces of [tokens, hidden] per layer.
A step is ``--layers`` layers (32 by default, the same weights each time, like a 32-layer
model). For hidden 4096 and 8192 it times decode steps at batch 1, 8, 32, 64 and a 2048-token
prefill, each captured in one CUDA graph per provider. A provider is how a layer sums its
row-parallel products and norms the result (``mixes``: ``hf`` -- all-reduce, ``x + o`` and the
Hugging Face Llama RMSNorm, several PyTorch kernels; ``fn`` -- the same with ``torch.rms_norm``,
one kernel; ``epi`` -- ``Communicator.all_reduce_add_rms_norm``, the add and the norm inside
the all-reduce's kernel) and which all-reduce: NCCL through ``torch.distributed``, or a
``zero_copy=True`` ``purlin.torch.Communicator`` (protocol ``auto``: each size's strategy from
the tuning table) with the row-parallel products written straight into its input region
(``comm.input_buffer``; the kernel writes the result over it: no copy in or out). ``none`` /
``none-fn`` skip the all-reduces (wrong results, not checked): the step without
communication, so ``nccl / none`` bounds what any all-reduce could gain. ``purlin-epi`` runs
the epilogue on the one-shot kernel where it can (LL sizes), ``purlin-epi-fused`` on the fused
kernel with the NORM op (``epilogue_kernel="fused"``). Every provider's
one-layer output must agree with NCCL's (bf16 tolerance). Prints a table and writes
``<out>/tp_decoder.json``, with what the all-reduce ran (``Communicator.plans``; ``epilogues``:
the programs with the RMSNorm epilogue).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
import warnings
from functools import partial

from purlin.bench.scripts import gpu_env, missing_gpus, output, write_json
from purlin.bench.torch_dist import graph_median_us

gpu_env()  # before the ranks' processes start NCCL

MODELS = {4096: dict(heads=32, kv_heads=8, ffn=14336), 8192: dict(heads=64, kv_heads=8, ffn=28672)}
HEAD_DIM = 128
EPS = 1e-5


class Layer:
    """This rank's shard of one decoder layer; ``allreduce(t)`` sums ``t`` over the TP group
    in place."""

    def __init__(self, torch, hidden: int, tp: int, rank: int, device, seed: int = 0):
        cfg = MODELS[hidden]
        self.torch = torch
        self.hidden, self.tp = hidden, tp
        self.heads, self.kv_heads = cfg["heads"] // tp, cfg["kv_heads"] // tp
        self.ffn = cfg["ffn"] // tp
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)

        def weight(rows, cols):
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return (w / math.sqrt(rows)).to(torch.bfloat16)

        q_cols = (self.heads + 2 * self.kv_heads) * HEAD_DIM
        self.w_qkv = weight(hidden, q_cols)
        self.w_o = weight(self.heads * HEAD_DIM, hidden)
        self.w_gate_up = weight(hidden, 2 * self.ffn)
        self.w_down = weight(self.ffn, hidden)
        self.norm1 = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        self.norm2 = torch.ones(hidden, device=device, dtype=torch.bfloat16)

    def rms(self, x, w):
        """The Hugging Face Llama RMSNorm, as written there."""
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + EPS)).to(torch.bfloat16) * w

    @staticmethod
    def rotary(torch, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x, h, state, mix, staging=None):
        """One layer: ``x`` the residual stream [batch, seq, hidden], ``h`` its norm (the
        previous layer's last ``mix``, or the step's first norm); returns the next (x, h).
        ``mix(o, x, w)`` sums the row-parallel product ``o`` over the TP group, adds it to
        ``x`` and returns (x, rms_norm(x) * w). ``staging(tokens)``, if given, is where the
        row-parallel products are written (the all-reduce's own input region: no copy in)."""
        torch, F = self.torch, self.torch.nn.functional
        b, s, _ = x.shape
        qkv = h @ self.w_qkv
        q, k, v = qkv.split([self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM,
                             self.kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q = self.rotary(torch, q, state["cos"], state["sin"])
        k = self.rotary(torch, k, state["cos"], state["sin"])
        if "k_cache" in state:  # decode: the new token goes into the cache's last slot
            state["k_cache"][:, :, -1:].copy_(k)
            state["v_cache"][:, :, -1:].copy_(v)
            attn = F.scaled_dot_product_attention(q, state["k_cache"], state["v_cache"],
                                                  enable_gqa=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        attn = attn.transpose(1, 2).reshape(b * s, self.heads * HEAD_DIM)
        o = torch.matmul(attn, self.w_o, out=staging(b * s)) if staging else attn @ self.w_o
        x, h = mix(o, x, self.norm2)
        gate, up = (h.view(b * s, -1) @ self.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        mlp = torch.matmul(act, self.w_down, out=staging(b * s)) if staging else act @ self.w_down
        return mix(mlp, x, self.norm1)  # the next layer's input norm (same weights)


def mixes(torch, layer):
    """The ways a layer sums its row-parallel products and norms the result, as ``{name:
    (make_mix, first_norm)}``: ``hf`` -- the all-reduce, ``x + o`` and the Hugging Face Llama
    RMSNorm (several PyTorch kernels); ``fn`` -- the all-reduce, ``x + o`` and
    ``torch.rms_norm`` (one fused kernel); ``epi`` -- ``Communicator.all_reduce_add_rms_norm``
    (one kernel where the fused kernel runs it; the residual is updated in place).
    ``make_mix`` takes the all-reduce (``epi``: the communicator); ``first_norm(x, w)`` is the
    norm a step starts with."""
    def fused_norm(x, w):
        return torch.rms_norm(x, (layer.hidden,), w, EPS)

    def unfused(norm):
        def make(ar):
            def mix(o, x, w):
                ar(o)
                x = x + o.view(x.shape)
                return x, norm(x, w)
            return mix
        return make

    def epi(comm):
        def mix(o, x, w):
            comm.all_reduce_add_rms_norm(o, x, w, EPS)
            return x, o.view(x.shape)
        return mix

    return {"hf": (unfused(layer.rms), layer.rms), "fn": (unfused(fused_norm), fused_norm),
            "epi": (epi, fused_norm)}


def make_state(torch, layer, batch, seq, kv, device, decode, gen):
    pos = torch.arange(kv - 1, kv, device=device) if decode else torch.arange(seq, device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM // 2, device=device).float() / (HEAD_DIM // 2)))
    ang = pos.float()[:, None] * inv[None, :]
    state = {"cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16)}
    if decode:
        shape = (batch, layer.kv_heads, kv, HEAD_DIM)
        state["k_cache"] = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        state["v_cache"] = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    return state


PROVIDERS = {  # name: (mix, all-reduce, row-parallel products into the staging input)
    "nccl": ("hf", "nccl", False),
    "purlin-zc": ("hf", "zc", True),
    "none": ("hf", "none", False),
    "nccl-fn": ("fn", "nccl", False),
    "purlin-zc-fn": ("fn", "zc", True),
    "none-fn": ("fn", "none", False),
    "purlin-epi": ("epi", "zc", True),
    "purlin-epi-fused": ("epi", "zc-fused", True),
}


def worker(rank, world, opts):
    import torch
    import torch.distributed as dist

    from purlin.torch import Communicator

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda", torch.cuda.current_device())
    comm_zc = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto",
                           zero_copy=True, epilogue_grid=opts.get("epi_grid"))
    # the epilogue on the fused kernel with the NORM op, where comm_zc runs the one-shot kernel
    comm_fk = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto",
                           zero_copy=True, epilogue_grid=opts.get("epi_grid"),
                           epilogue_kernel="fused")
    epi_comms = {"zc": comm_zc, "zc-fused": comm_fk}
    ars = {"nccl": lambda t: dist.all_reduce(t), "zc": comm_zc.all_reduce,
           "none": lambda t: None}
    rows = []
    for hidden in opts["hidden"]:
        layer = Layer(torch, hidden, world, rank, device)
        mix_of = mixes(torch, layer)

        def staging(tokens, hidden=hidden):  # the all-reduce's input region, [tokens, hidden]
            return comm_zc.input_buffer("all_reduce", tokens * hidden, torch.bfloat16).view(
                tokens, hidden)

        def staging_epi(tokens, hidden=hidden, comm=comm_zc):  # all_reduce_add_rms_norm's
            return comm.input_buffer("all_reduce_add_rms_norm", tokens * hidden,
                                        torch.bfloat16, hidden=hidden).view(tokens, hidden)

        configs = [("decode", b, 1) for b in opts["batches"]] + (
            [("prefill", 1, opts["prefill"])] if opts["prefill"] else [])
        for phase, batch, seq in configs:
            row = {"hidden": hidden, "phase": phase, "batch": batch, "seq": seq,
                   "tokens": batch * seq, "allreduce_bytes": batch * seq * hidden * 2}
            try:
                gen = torch.Generator(device=device).manual_seed(42 + batch + seq)
                state = make_state(torch, layer, batch, seq, opts["kv"], device,
                                   phase == "decode", gen)
                x0 = torch.randn(batch, seq, hidden, generator=gen, device=device).to(
                    torch.bfloat16)
                res = torch.empty_like(x0)  # the residual stream a step updates in place
                outs = {}
                for name in opts["providers"]:
                    how, ar, staged = PROVIDERS[name]
                    make_mix, first = mix_of[how]
                    mix = make_mix(epi_comms[ar] if how == "epi" else ars[ar])
                    stage = (partial(staging_epi, comm=epi_comms[ar]) if how == "epi"
                             else staging) if staged else None
                    out = torch.empty_like(x0)

                    def step(mix=mix, first=first, stage=stage, out=out, layers=opts["layers"]):
                        res.copy_(x0)
                        x, h = res, first(res, layer.norm1)
                        for _ in range(layers):
                            x, h = layer.forward(x, h, state, mix, stage)
                        out.copy_(h)

                    # agreement on one layer: through many layers of random weights, bf16
                    # rounding differences of two correct all-reduces grow without meaning
                    step(layers=1)
                    outs[name] = out.float()
                    # per replay of one graph, slowest rank; the step's outputs then hold
                    # the last replay's results
                    us = graph_median_us(torch, step, 1, opts["replays"], dist)
                    row[f"{name}_us"] = us
                    row[f"{name}_tokens_per_s"] = row["tokens"] / (us * 1e-6)
                for c in epi_comms.values():
                    c.check()
                count = batch * seq * hidden
                ran = [p for c in epi_comms.values() for p in c.plans() if p["function"] in (
                    "all-reduce", "all-reduce-add-rms-norm") and p["count"] == count
                       and p["dtype"] == "bfloat16"]
                row["ran"] = [{k: p.get(k) for k in ("function", "strategy", "chunks", "lanes",
                                                     "protocol", "pdl", "blocks_per_lane",
                                                     "epilogues", "norm_kernel")}
                              for p in ran]
                _agreement(torch, row, outs)
                _ratios(row, opts["layers"])
            except Exception:  # noqa: BLE001 - keep the other configurations
                row["error"] = traceback.format_exc(limit=6)
            rows.append(row)
            torch.cuda.empty_cache()
        layer = None  # free this size's weights before the next
    return rows


def _agreement(torch, row, outs):
    """Every provider that all-reduces agrees with NCCL's layer output (bf16 tolerance)."""
    want = outs["nccl"]
    scale = want.abs().max().item()
    row["output_scale"], row["agree"], row["max_abs_diff"] = scale, True, 0.0
    for name, got in outs.items():
        if name.startswith("none") or name == "nccl":
            continue
        diff = (got - want).abs().max().item()
        row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * max(scale, 1.0)))
        row[f"{name}_agree"] = ok
        row["agree"] &= ok


def _ratios(row, layers):
    """Speedups over NCCL (same norm, and the epilogue against both), and what one
    all-reduce (with its add and norm) costs inside the layer: 2 per layer."""
    for name, base in (("purlin-zc", "nccl"), ("purlin-zc-fn", "nccl-fn"),
                       ("purlin-epi", "nccl-fn"), ("purlin-epi", "nccl"),
                       ("purlin-epi-fused", "nccl-fn")):
        if f"{name}_us" in row and f"{base}_us" in row:
            row[f"{name}_vs_{base}"] = row[f"{base}_us"] / row[f"{name}_us"]
    for name, base in (("nccl", "none"), ("purlin-zc", "none"), ("nccl-fn", "none-fn"),
                       ("purlin-zc-fn", "none-fn"), ("purlin-epi", "none-fn"),
                       ("purlin-epi-fused", "none-fn")):
        if f"{name}_us" in row and f"{base}_us" in row:
            row[f"{name}_per_call_us"] = (row[f"{name}_us"] - row[f"{base}_us"]) / (2 * layers)
    for name, base in (("nccl", "none"), ("nccl-fn", "none-fn")):
        if f"{name}_us" in row and f"{base}_us" in row:
            row[f"{base}_bound"] = row[f"{name}_us"] / row[f"{base}_us"]


def print_table(rows) -> bool:
    ok = True
    layers = rows[0].get("layers", 1) if rows else 1
    print(f"\nTP=2 decoder, {layers} layers per step, bf16, CUDA graphs; step latency in us "
          "(slowest rank). hf: all-reduce, x + o and the Hugging Face RMSNorm; fn: the same "
          "with torch.rms_norm; epi: Purlin's all-reduce with the add and the RMSNorm in its "
          "kernel. Speedups: over NCCL with the same norm, and epi over nccl-fn and nccl.")
    print(f"{'hidden':>6} {'phase':>7} {'batch':>5} {'AR size':>9} {'nccl':>8} {'zc':>8} "
          f"{'x':>5} {'nccl-fn':>8} {'zc-fn':>8} {'x':>5} {'epi':>8} {'x fn':>5} {'x hf':>5} "
          f"{'bound':>5} {'agree':>5}  per call in the layer (us): nccl-fn / zc-fn / epi; ran")
    for r in rows:
        if "error" in r:
            print(f"{r['hidden']:>6} {r['phase']:>7} {r['batch']:>5} ERROR\n{r['error']}")
            ok = False
            continue
        size = r["allreduce_bytes"]
        size_s = f"{size // 1024} KiB" if size < 1 << 20 else f"{size / (1 << 20):.0f} MiB"
        ran = next((p for p in r.get("ran") or [] if p.get("function") == "all-reduce"), {})
        epi = next((p for p in r.get("ran") or [] if p.get("function") != "all-reduce"
                    and p.get("epilogues")), {})
        g = r.get
        print(f"{r['hidden']:>6} {r['phase']:>7} {r['batch']:>5} {size_s:>9} "
              f"{g('nccl_us', 0):8.1f} {g('purlin-zc_us', 0):8.1f} "
              f"{g('purlin-zc_vs_nccl', 0):5.2f} {g('nccl-fn_us', 0):8.1f} "
              f"{g('purlin-zc-fn_us', 0):8.1f} {g('purlin-zc-fn_vs_nccl-fn', 0):5.2f} "
              f"{g('purlin-epi_us', 0):8.1f} {g('purlin-epi_vs_nccl-fn', 0):5.2f} "
              f"{g('purlin-epi_vs_nccl', 0):5.2f} {g('none-fn_bound', 0):5.2f} "
              f"{'yes' if r['agree'] else 'NO':>5}  "
              + " / ".join(f"{g(f'{n}_per_call_us', 0):.1f}" for n in (
                  "nccl-fn", "purlin-zc-fn", "purlin-epi"))
              + f"; {ran.get('strategy')} {ran.get('protocol')}"
              f"{' pdl' if ran.get('pdl') else ''} b{ran.get('blocks_per_lane')}; epi "
              f"{epi.get('protocol')} b{epi.get('blocks_per_lane')} epilogues "
              f"{epi.get('epilogues')} on {epi.get('norm_kernel')}"
              + (f"; epi on fused-norm {g('purlin-epi-fused_us'):.1f} us "
                 f"x{g('purlin-epi-fused_vs_nccl-fn', 0):.2f} "
                 f"per call {g('purlin-epi-fused_per_call_us', 0):.1f}"
                 if g("purlin-epi-fused_us") else ""))
        ok &= r["agree"]
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prefill", type=int, default=2048, help="tokens (0: no prefill)")
    ap.add_argument("--kv", type=int, default=1024)
    # a step runs --layers layers (the same weights each time), as a decode step of a whole
    # model does; one graph replay then carries one step, and the skew between the two ranks'
    # replay launches (tens of µs) is paid once per step instead of once per layer
    ap.add_argument("--layers", type=int, default=32, help="layers per step (same weights)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--staging", type=int, default=512 << 20)
    ap.add_argument("--epi-grid", default=None,
                    help="the epilogue's grid (Communicator epilogue_grid: 'rows' or threads "
                    "per block; default: the all-reduce's)")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help="of " + ", ".join(PROVIDERS) + " (nccl first)")
    args = ap.parse_args(argv)
    why = missing_gpus(2, "bench/tp_decoder.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    from purlin.torch.testing import run_processes

    opts = {"hidden": [int(h) for h in args.hidden.split(",")],
            "batches": [int(b) for b in args.batches.split(",")], "prefill": args.prefill,
            "kv": args.kv, "layers": args.layers, "replays": args.replays,
            "staging": args.staging, "providers": args.providers.split(","),
            "epi_grid": (args.epi_grid if args.epi_grid in (None, "rows")
                         else int(args.epi_grid))}
    t0 = time.time()
    outcomes = run_processes(worker, 2, opts, backend="nccl", timeout=230, pg_timeout=120)
    if outcomes[0][0] != "ok":
        for rank, (status, value) in enumerate(outcomes):
            print(f"rank {rank} {status}: {value}")
        return 1
    rows = outcomes[0][1]
    for r in rows:
        r["layers"] = args.layers
    ok = print_table(rows) and all(s == "ok" for s, _ in outcomes)
    path = write_json(output(args.out, "tp_decoder.json"),
                      {"ok": ok, "seconds": time.time() - t0, "options": opts, "rows": rows})
    print(f"\n{'PASS' if ok else 'FAIL'}; wrote {path} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
