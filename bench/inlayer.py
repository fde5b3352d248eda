"""What a small all-reduce costs inside a decoder layer, and why: after a row-parallel GEMV.

    python3 bench/inlayer.py [--out outputs/inlayer.json]      # 2 GPUs, ~1 minute

Back to back, Purlin's 8 KiB all-reduce takes ~3.5 µs; inside the TP=2 decoder
(``bench/tp_decoder.py``) a call costs ~6.5 µs more than the step without it. This
probe finds where the difference goes. One process per GPU; a CUDA graph holds ``--ops``
repetitions of ``pre`` then ``op``, and an op's cost is (graph time - the graph of ``pre``
alone) / ops, slowest rank, median of ``--replays``. ``pre`` is what comes before the
all-reduce:

* ``copy``   -- an 8 KiB copy into the all-reduce's input (the caches stay warm: the
  all-reduce's own back-to-back cost);
* ``gemv``   -- the decoder's down projection at batch 1, hidden 4096 (``[1, 7168] @ [7168,
  4096]``, 59 MB of weights: every cache line of the all-reduce's state is evicted), written
  straight into the all-reduce's input, as the decoder does.

``op``: ``elementwise`` (one 8 KiB kernel: what any kernel costs there), ``nccl``
(``dist.all_reduce``), ``purlin`` (a zero-copy ``Communicator``'s all-reduce), ``epi``
(``all_reduce_add_rms_norm``; on LL sizes the one-shot kernel) and ``epi-fused`` (the same on
the fused kernel with the NORM op) against ``purlin+norm`` / ``nccl+norm`` (the add and
``torch.rms_norm`` after the all-reduce); ``epi:G`` /
``ar:G``: the epilogue on grid G (``Communicator(epilogue_grid=G)``) and its all-reduce
without it; ``epi(no-trade)`` / ``epi(no-norm)``: the epilogue with a part left out (its
program rewritten: no row sums traded between blocks; no epilogue work at all -- on the
one-shot kernel that also leaves out the exchange: an empty launch reading its program).
Prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time

from purlin.bench.scripts import gpu_env, missing_gpus, output, write_json

gpu_env()  # before the ranks' processes start NCCL

HIDDEN, FFN = 4096, 7168  # the decoder's hidden size and one rank's share of its MLP
EPS = 1e-5
OPS = ("none", "elementwise", "nccl", "purlin", "nccl+norm", "purlin+norm", "epi", "epi-fused")


def _epilogue_words(comm):
    """The device words of ``comm``'s one program that ends with the RMSNorm epilogue."""
    import torch

    from purlin.torch.comm import _norm_key

    prepared = comm._cache[_norm_key(HIDDEN, torch.bfloat16, HIDDEN)]
    (words,) = [w for key, w in prepared._moved.items() if len(key) > 2]
    return words


def worker(rank, world, opts):
    import torch
    import torch.distributed as dist

    from purlin.bench.torch_dist import graph_median_us
    from purlin.kernels import isa
    from purlin.torch import Communicator
    from purlin.torch.comm import _norm_key

    comm = Communicator(staging_bytes=64 << 20, timeout=10.0, protocol="auto", zero_copy=True)
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    act = torch.randn(1, FFN, generator=gen, device="cuda").to(torch.bfloat16)
    w_down = (torch.randn(FFN, HIDDEN, generator=gen, device="cuda") / FFN ** 0.5).to(
        torch.bfloat16)
    src = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    staging = comm.input_buffer("all_reduce", HIDDEN, torch.bfloat16).view(1, HIDDEN)
    staging_epi = comm.input_buffer("all_reduce_add_rms_norm", HIDDEN, torch.bfloat16,
                                    hidden=HIDDEN).view(1, HIDDEN)
    residual = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    pres = {"copy": lambda t: t.copy_(src),
            "gemv": lambda t: torch.matmul(act, w_down, out=t)}

    def norm():  # the decoder's unfused add and norm: two kernels
        return torch.rms_norm(residual.add_(staging), (HIDDEN,), weight, EPS)

    ops = {"none": lambda: None, "elementwise": lambda: staging.mul_(1),
           "nccl": lambda: dist.all_reduce(staging), "purlin": lambda: comm.all_reduce(staging),
           "nccl+norm": lambda: (dist.all_reduce(staging), norm()),
           "purlin+norm": lambda: (comm.all_reduce(staging), norm()),
           "epi": lambda: comm.all_reduce_add_rms_norm(staging_epi, residual, weight, EPS)}
    into = {"epi": staging_epi}  # an op's input region, where not the all-reduce's
    # the epilogue on the fused kernel with the NORM op (where "epi" runs the one-shot kernel)
    comm_fk = Communicator(staging_bytes=8 << 20, timeout=10.0, protocol="auto",
                           zero_copy=True, epilogue_kernel="fused")
    into["epi-fused"] = comm_fk.input_buffer("all_reduce_add_rms_norm", HIDDEN, torch.bfloat16,
                                             hidden=HIDDEN).view(1, HIDDEN)
    ops["epi-fused"] = lambda: comm_fk.all_reduce_add_rms_norm(into["epi-fused"], residual,
                                                              weight, EPS)
    # the epilogue on other grids (Communicator(epilogue_grid=...)), and the same all-reduce
    # without it: what the grid costs the all-reduce, and what the norm costs on it
    comms = {"": comm, "-fused": comm_fk}
    for grid in opts["grids"]:
        other = Communicator(staging_bytes=8 << 20, timeout=10.0, protocol="auto",
                             zero_copy=True, epilogue_grid=grid)
        region = other.input_buffer("all_reduce_add_rms_norm", HIDDEN, torch.bfloat16,
                                    hidden=HIDDEN).view(1, HIDDEN)
        comms[f":{grid}"] = other
        ops[f"epi:{grid}"] = lambda c=other, t=region: c.all_reduce_add_rms_norm(
            t, residual, weight, EPS)
        # (the epilogue's prepared all-reduce run plain: a private call, for this probe)
        ops[f"ar:{grid}"] = lambda c=other, t=region: c._call(
            _norm_key(HIDDEN, torch.bfloat16, HIDDEN), t, t)
        into[f"epi:{grid}"] = into[f"ar:{grid}"] = region

    def measure(pre, op, region) -> float:
        def body():
            pre(region)
            op()

        return graph_median_us(torch, body, opts["ops_per_graph"], opts["replays"], dist)

    rows, base = [], {}
    for pre_name, pre in pres.items():
        for op_name in opts["ops"] + [f"{k}:{g}" for g in opts["grids"] for k in ("ar", "epi")]:
            us = measure(pre, ops[op_name], into.get(op_name, staging))
            base.setdefault(pre_name, us)  # the first op is none
            rows.append({"pre": pre_name, "op": op_name, "us_per_pair": us,
                         "op_us": us - base[pre_name] if op_name != "none" else None})
    # the epilogue's parts, left out one at a time by rewriting its program's NORM op (the
    # results are then wrong, and not looked at): chunks per row 1 -- no row sums traded
    # between blocks; chunks 0 -- no epilogue work at all (the fused_norm kernel all the same)
    for grid, c in comms.items():
        if grid not in ("", "-fused", ":rows"):
            continue
        name = f"epi{grid}"
        words = _epilogue_words(c)
        at = isa.F_HEAD + (int(words[isa.F_NOPS]) - 1) * isa.OP_WIDTH
        assert int(words[at]) == isa.F_OP_NORM, "the epilogue program's last op is not NORM"
        saved = words.clone()
        for part, (index, value) in (("no-trade", (at + 7, 1)), ("no-norm", (at + 6, 0))):
            for pre_name, pre in pres.items():
                words[index] = value
                torch.cuda.synchronize()
                us = measure(pre, ops[name], into[name])
                rows.append({"pre": pre_name, "op": f"{name}({part})", "us_per_pair": us,
                             "op_us": us - base[pre_name]})
                words.copy_(saved)
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    for c in comms.values():
        c.check()
    plans = [{"grid": g, **{k: p.get(k) for k in ("function", "strategy", "protocol", "pdl",
                                                  "blocks_per_lane", "epilogues",
                                                  "norm_kernel")}}
             for g, c in comms.items() for p in c.plans() if p["count"] == HIDDEN]
    return {"rows": rows, "ran": plans}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--ops", default=",".join(OPS), help="of " + ", ".join(OPS))
    ap.add_argument("--grids", default="rows,32,64,128",
                    help="epilogue grids to try besides the default (Communicator's "
                    "epilogue_grid: 'rows' or threads per block)")
    ap.add_argument("--ops-per-graph", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    why = missing_gpus(2, "bench/inlayer.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    from purlin.torch.testing import run_processes

    ops = args.ops.split(",")
    if ops[0] != "none":
        ops.insert(0, "none")
    grids = [g if g == "rows" else int(g) for g in args.grids.split(",") if g]
    opts = {"ops": ops, "grids": grids, "ops_per_graph": args.ops_per_graph,
            "replays": args.replays}
    t0 = time.time()
    outcomes = run_processes(worker, 2, opts, backend="nccl", timeout=200, pg_timeout=120)
    if any(status != "ok" for status, _ in outcomes):
        for rank, (status, value) in enumerate(outcomes):
            print(f"rank {rank} {status}: {value}")
        return 1
    result = outcomes[0][1]
    print(f"\nWhat one op costs after `pre` (µs, (graph - graph of pre alone) / "
          f"{args.ops_per_graph}, slowest rank); epi:G / ar:G -- the epilogue on grid G "
          "and its all-reduce without it. Ran:")
    for p in result["ran"]:
        print("   ", p)
    print(f"{'op':>16} {'after copy':>11} {'after gemv':>11}   (none: the time of pre alone)")
    by = {(r["pre"], r["op"]): r for r in result["rows"]}
    parts = [f"epi{g}({p})" for g in ("", "-fused", ":rows") if g != ":rows" or "rows" in grids
             for p in ("no-trade", "no-norm")]
    for op in ops + [f"{k}:{g}" for g in grids for k in ("ar", "epi")] + parts:
        cells = []
        for pre in ("copy", "gemv"):
            r = by[(pre, op)]
            cells.append(f"({r['us_per_pair']:.2f})" if op == "none"
                         else f"{r['op_us']:.2f}")
        print(f"{op:>16} {cells[0]:>11} {cells[1]:>11}")
    path = write_json(output(args.out, "inlayer.json"),
                      {"seconds": time.time() - t0, "options": opts, **result})
    print(f"wrote {path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
