"""A tensor-parallel Llama-style decoder layer, NCCL vs Purlin all-reduce, under CUDA graphs.

    PYTHONPATH=. python bench/apps/tp_decoder.py --out $OUT          # 2 GPUs, ~1-2 minutes

One process per GPU (TP=2). Each rank holds its shard of a Llama-style layer with random bf16
weights: RMSNorm, attention (column-parallel fused QKV with grouped KV heads and rotary
embeddings, ``scaled_dot_product_attention`` over a KV cache of ``--kv`` tokens when decoding,
causal over the prompt when prefilling, row-parallel output projection) and a SwiGLU MLP
(column-parallel gate/up, row-parallel down) -- two all-reduces of [tokens, hidden] per layer.
A step is ``--layers`` layers (32 by default, the same weights each time, like a 32-layer
model). For hidden 4096 and 8192 it times decode steps at batch 1, 8, 32, 64 and a 2048-token
prefill, each captured in one CUDA graph per all-reduce provider --
``torch.distributed.all_reduce`` on NCCL; ``purlin.torch.Communicator(protocol="auto")``'s
``all_reduce`` (each size's strategy and protocol from the tuning table: the fused kernel
where it was fastest); the same with the
row-parallel products written straight into ``comm.input_buffer`` (no copy in); and that on a
``zero_copy=True`` communicator (the kernel writes the result over its input there: no copy out
either) -- and checks that every provider's layer output agrees with NCCL's (bf16
tolerance). ``none`` skips the all-reduces (wrong results, not checked): the step without
communication, so ``nccl / none`` bounds what any all-reduce could gain; ``one-kernel`` puts
an in-place elementwise kernel of the same size where the all-reduce was (what a kernel there
costs, whatever it does); ``purlin-zc-nopdl`` is the zero-copy provider without programmatic
dependent launch. Prints a table and
writes ``<out>/tp_decoder.json``, with what each provider's all-reduce ran
(``Communicator.plans``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = {4096: dict(heads=32, kv_heads=8, ffn=14336), 8192: dict(heads=64, kv_heads=8, ffn=28672)}
HEAD_DIM = 128


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
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(torch.bfloat16) * w

    @staticmethod
    def rotary(torch, x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x, state, allreduce, staging=None):
        """x: [batch, seq, hidden]; state: rotary tables and (decode) the KV cache.
        ``staging(tokens)``, if given, is where the row-parallel products are written (the
        all-reduce's own input region: no copy in)."""
        torch, F = self.torch, self.torch.nn.functional
        b, s, _ = x.shape
        h = self.rms(x, self.norm1)
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
        allreduce(o)
        x = x + o.view(b, s, -1)
        h = self.rms(x, self.norm2)
        gate, up = (h.view(b * s, -1) @ self.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        mlp = torch.matmul(act, self.w_down, out=staging(b * s)) if staging else act @ self.w_down
        allreduce(mlp)
        return x + mlp.view(b, s, -1)


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


def time_graph(torch, dist, step, replays):
    """Median per-replay time (us) of ``step`` captured in a CUDA graph, slowest rank; the
    step's outputs hold the last replay's results afterwards."""
    from purlin.bench.torch_dist import graph_per_op_us

    times = sorted(graph_per_op_us(torch, step, 1, replays, dist))
    t = torch.tensor([times[len(times) // 2]], device=torch.cuda.current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, world, opts):
    import torch
    import torch.distributed as dist

    from purlin.torch import Communicator

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto")
    comm_zc = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto",
                           zero_copy=True)
    comm_nopdl = Communicator(staging_bytes=opts["staging"], timeout=10.0, protocol="auto",
                              zero_copy=True, pdl=False)

    def staging(c):  # the all-reduce's input region of communicator c, [tokens, hidden]
        return lambda hidden: (lambda tokens: c.input_buffer(
            "all_reduce", tokens * hidden, torch.bfloat16).view(tokens, hidden))

    providers = {"nccl": (lambda t: dist.all_reduce(t), None),
                 "purlin": (comm.all_reduce, None),
                 "purlin-inplace": (comm.all_reduce, staging(comm)),
                 "purlin-zc-inplace": (comm_zc.all_reduce, staging(comm_zc)),
                 "purlin-zc-nopdl": (comm_nopdl.all_reduce, staging(comm_nopdl)),
                 "none": (lambda t: None, None),
                 "one-kernel": (lambda t: t.mul_(1), None)}
    rows = []
    for hidden in opts["hidden"]:
        layer = Layer(torch, hidden, world, rank, device)
        configs = [("decode", b, 1) for b in opts["batches"]] + [("prefill", 1, opts["prefill"])]
        for phase, batch, seq in configs:
            row = {"hidden": hidden, "phase": phase, "batch": batch, "seq": seq,
                   "tokens": batch * seq, "allreduce_bytes": batch * seq * hidden * 2}
            try:
                gen = torch.Generator(device=device).manual_seed(42 + batch + seq)
                state = make_state(torch, layer, batch, seq, opts["kv"], device,
                                   phase == "decode", gen)
                x = torch.randn(batch, seq, hidden, generator=gen, device=device).to(
                    torch.bfloat16)
                outs = {}
                for name, (ar, stage) in providers.items():
                    out = torch.empty_like(x)
                    stage = stage(hidden) if stage else None
                    # agreement on one layer: through many layers of random weights, bf16
                    # rounding differences of two correct all-reduces grow without meaning
                    outs[name] = layer.forward(x, state, ar, stage).float()

                    def step(ar=ar, out=out, stage=stage):
                        y = x
                        for _ in range(opts["layers"]):
                            y = layer.forward(y, state, ar, stage)
                        out.copy_(y)

                    us = time_graph(torch, dist, step, opts["replays"])
                    row[f"{name}_us"] = us
                    row[f"{name}_tokens_per_s"] = row["tokens"] / (us * 1e-6)
                comm.check()
                comm_zc.check()
                comm_nopdl.check()
                count = batch * seq * hidden
                row["ran"] = [{k: p.get(k) for k in ("strategy", "chunks", "lanes", "protocol",
                                                     "pdl", "blocks_per_lane")}
                              for p in comm.plans() if p["function"] == "all-reduce"
                              and p["count"] == count and p["dtype"] == "bfloat16"][:1]
                scale = outs["nccl"].abs().max().item()
                row["output_scale"] = scale
                row["agree"] = True
                for name in providers:
                    if name in ("nccl", "none", "one-kernel"):
                        continue
                    diff = (outs[name] - outs["nccl"]).abs().max().item()
                    row["max_abs_diff"] = max(row.get("max_abs_diff", 0.0), diff)
                    row["agree"] &= bool(torch.allclose(outs[name], outs["nccl"], rtol=2e-2,
                                                        atol=2e-2 * max(scale, 1.0)))
                    row[f"{name}_speedup"] = row["nccl_us"] / row[f"{name}_us"]
                row["bound_speedup"] = row["nccl_us"] / row["none_us"]
                for name in ("nccl", "purlin-zc-inplace", "purlin-zc-nopdl", "one-kernel"):
                    # what one all-reduce (or kernel) costs inside the layer: 2 per layer
                    row[f"{name}_per_call_us"] = (row[f"{name}_us"] - row["none_us"]) / (
                        2 * opts["layers"])
            except Exception:  # noqa: BLE001 - keep the other configurations
                row["error"] = traceback.format_exc(limit=6)
            rows.append(row)
            torch.cuda.empty_cache()
        layer = None  # free this size's weights before the next
    return rows


def print_table(rows) -> bool:
    ok = True
    layers = rows[0].get("layers", 1) if rows else 1
    print(f"\nTP=2 decoder layer x{layers}, bf16, CUDA graphs; step latency in us (slowest rank). "
          "purlin: comm.all_reduce(t) (protocol auto); inplace: the row-parallel matmul writes "
          "into comm.input_buffer (no copy in); zc: that with zero_copy=True (no copy out)")
    print(f"{'hidden':>6} {'phase':>7} {'batch':>5} {'tokens':>6} {'AR size':>9} "
          f"{'nccl':>8} {'purlin':>8} {'inplace':>8} {'zc':>8} {'speedup':>7} {'inplace':>7} "
          f"{'zc':>7} {'no AR':>8} {'bound':>6} {'nccl tok/s':>11} {'purlin tok/s':>12} "
          f"{'agree':>5} {'max|diff|':>9}  ran; per call in the layer: nccl / zc / zc no PDL "
          "/ one kernel (us)")
    for r in rows:
        if "error" in r:
            print(f"{r['hidden']:>6} {r['phase']:>7} {r['batch']:>5} ERROR\n{r['error']}")
            ok = False
            continue
        size = r["allreduce_bytes"]
        size_s = f"{size // 1024} KiB" if size < 1 << 20 else f"{size / (1 << 20):.0f} MiB"
        best = max(r["purlin_tokens_per_s"], r["purlin-inplace_tokens_per_s"],
                   r["purlin-zc-inplace_tokens_per_s"])
        ran = (r.get("ran") or [{}])[0]
        print(f"{r['hidden']:>6} {r['phase']:>7} {r['batch']:>5} {r['tokens']:>6} {size_s:>9} "
              f"{r['nccl_us']:8.1f} {r['purlin_us']:8.1f} {r['purlin-inplace_us']:8.1f} "
              f"{r['purlin-zc-inplace_us']:8.1f} "
              f"{r['purlin_speedup']:7.2f} {r['purlin-inplace_speedup']:7.2f} "
              f"{r['purlin-zc-inplace_speedup']:7.2f} {r['none_us']:8.1f} "
              f"{r['bound_speedup']:6.2f} {r['nccl_tokens_per_s']:11.0f} {best:12.0f} "
              f"{'yes' if r['agree'] else 'NO':>5} {r['max_abs_diff']:9.2g}  "
              f"{ran.get('strategy')} {ran.get('protocol')}{' pdl' if ran.get('pdl') else ''}; "
              + " / ".join(f"{r[f'{n}_per_call_us']:.1f}" for n in (
                  "nccl", "purlin-zc-inplace", "purlin-zc-nopdl", "one-kernel")))
        ok &= r["agree"]
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--kv", type=int, default=1024)
    # a step runs --layers layers (the same weights each time), as a decode step of a whole
    # model does; one graph replay then carries one step, and the skew between the two ranks'
    # replay launches (tens of µs) is paid once per step instead of once per layer
    ap.add_argument("--layers", type=int, default=32, help="layers per step (same weights)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--staging", type=int, default=512 << 20)
    args = ap.parse_args(argv)
    from purlin.torch.testing import run_processes

    opts = {"hidden": [int(h) for h in args.hidden.split(",")],
            "batches": [int(b) for b in args.batches.split(",")], "prefill": args.prefill,
            "kv": args.kv, "layers": args.layers, "replays": args.replays,
            "staging": args.staging}
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
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / "tp_decoder.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ok": ok, "seconds": time.time() - t0, "options": opts,
                                "rows": rows}, indent=1))
    print(f"\n{'PASS' if ok else 'FAIL'}; wrote {path} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
