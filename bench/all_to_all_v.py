"""The variable-length all-to-all with device-side counts against the plain all-to-all of the
same capacity, on virtual ranks of one GPU.

    PYTHONPATH=. python3 bench/all_to_all_v.py [--ranks 4,8] [--sizes 8KiB:64MiB]
        [--dtype bfloat16] [--row 64] [--protocol auto] [--out FOLDER_OR_FILE.json]

For each rank count and size (a rank's input at capacity), the counts are skewed as an MoE
router's are: one (sender, receiver) pair in eight gets the capacity, 4x the average, the
others less, so the rows actually sent are a quarter of the capacity. Three binds are timed
as CUDA-graph replays (device time per op, median): ``all_to_all_v`` (pack, the padded
all-to-all, unpack; counts in a device tensor), the padded all-to-all alone (what it runs
inside: capacity bytes plus a 16-byte header per chunk) and the plain all-to-all at capacity.
Every ``all_to_all_v`` result is checked once against the reference.

Budget: about 2 minutes on one H200 for the default sweep (two rank counts, 8 KiB to 64 MiB
by 4x). The JSON has one row per (ranks, size) and the environment.
"""

from __future__ import annotations

import argparse
import sys
import time

KiB, MiB = 1 << 10, 1 << 20
SIZES = tuple(8 * KiB * 4 ** i for i in range(7)) + (64 * MiB,)  # 8 KiB .. 32 MiB, 64 MiB
HOT = 8  # one pair in HOT gets the capacity (4x the average); the rest share what is left


def skewed_counts(n: int, cap: int) -> list[int]:
    """Rows per (sender, receiver), row-major: every HOT-th pair ``cap``, the rest so that the
    mean is ``cap / 4`` (the hot pairs get 4x the average).

    >>> c = skewed_counts(4, 64); max(c), sum(c) / len(c)
    (64, 16.0)
    """
    pairs = n * n
    hot = [(r * n + j) % HOT == 0 for r in range(n) for j in range(n)]
    total = pairs * cap // 4
    rest = total - cap * sum(hot)
    cold = pairs - sum(hot)
    out, left = [], rest
    for i, h in enumerate(hot):
        if h:
            out.append(cap)
        else:
            share = left // cold
            out.append(max(0, min(cap, share)))
            left -= out[-1]
            cold -= 1
    return out


def _time_graph(torch, fn, ops: int, repeats: int) -> list[float]:
    """Per-op microseconds over graph replays of ``ops`` calls of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(ops):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / ops)
    return out


def _time_eager(torch, fn, ops: int, repeats: int) -> list[float]:
    """Per-op microseconds of ``ops`` eager calls, timed with events on the stream."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ops):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / ops)
    return out


def _median(xs):
    return float(sorted(xs)[len(xs) // 2])


def measure(torch, n, nbytes, dtype, row, protocol, ops, repeats) -> dict:
    import numpy as np

    from purlin.bench.providers import time_graph
    from purlin.runtime import Cluster
    from purlin.spec import collectives
    from purlin.spec.dtypes import dtype as as_dtype
    from purlin.spec.varlen import all_to_all_v

    item = as_dtype(dtype).itemsize
    cap = max(1, nbytes // n // (row * item))
    cluster = Cluster.virtual(n)
    v = all_to_all_v(n, cap, row=row)
    how = ({"strategy": "auto"} if protocol == "auto" else
           {"strategy": "direct-push", "protocol": protocol})
    bound = cluster.bind(v, dtype=dtype, **how)
    host = skewed_counts(n, cap)
    dev = torch.device("cuda", 0)
    counts = torch.tensor(host, dtype=torch.int64, device=dev)
    rng = np.random.default_rng(0)
    values = [rng.integers(-8, 8, sum(host[r * n:(r + 1) * n]) * row).astype(np.float64)
              for r in range(n)]
    tdt = getattr(torch, dtype)
    ins = [torch.from_numpy(x).to(dev, tdt) for x in values]
    outs = bound(ins, host)  # eager, checked
    want = v.reference(values, host)
    wrong = sum(int((o.double().cpu().numpy() != w).sum()) for o, w in zip(outs, want))
    full = [torch.zeros(v.input_capacity(r), dtype=tdt, device=dev) for r in range(n)]
    for r in range(n):
        full[r][:ins[r].numel()] = ins[r]
    try:
        us_v, timing = _time_graph(torch, lambda: bound.launch(full, counts), ops, repeats), \
            "graph"
    except Exception as exc:  # noqa: BLE001 - a capture that fails still gets a number
        us_v, timing = _time_eager(torch, lambda: bound.launch(full, counts), ops, repeats), \
            f"eager (capture failed: {str(exc).splitlines()[0][:200]})"
    bound.check()
    us_padded = time_graph(torch, bound.bound, ops, repeats)
    plain = cluster.bind(collectives.all_to_all(n), dtype=dtype, **how,
                         chunk_sizes={name: cap * row for name in v.names})
    us_plain = time_graph(torch, plain, ops, repeats)
    sent = sum(host) * row * item
    row_out = {"nranks": n, "nbytes": nbytes, "dtype": dtype, "row": row, "capacity_rows": cap,
               "protocol": bound.bound.protocol, "bytes_sent": sent,
               "bytes_capacity": n * n * cap * row * item,
               "us_all_to_all_v": _median(us_v), "us_padded": _median(us_padded),
               "us_plain": _median(us_plain), "wrong": wrong, "timing_v": timing,
               "status": "ok" if wrong == 0 else "WRONG"}
    row_out["ratio_v_plain"] = row_out["us_all_to_all_v"] / row_out["us_plain"]
    row_out["pack_unpack_us"] = row_out["us_all_to_all_v"] - row_out["us_padded"]
    torch.cuda.empty_cache()
    return row_out


HEADER = (f"{'n':>2} {'size':>7} {'cap rows':>8} {'sent':>8} {'a2a_v us':>9} {'padded us':>9} "
          f"{'plain us':>9} {'v/plain':>7} {'pack+unpack':>11}")


def _size(b: int) -> str:
    return f"{b // MiB}M" if b >= MiB else f"{b // KiB}K" if b >= KiB else str(b)


def run(ranks=(4, 8), sizes=SIZES, dtype="bfloat16", row=64, protocol="auto", ops=20,
        repeats=7, log=sys.stdout) -> dict:
    import torch

    rows = []
    t0 = time.monotonic()
    if log is not None:
        print(HEADER, file=log)
    for n in ranks:
        for nbytes in sizes:
            r = measure(torch, n, nbytes, dtype, row, protocol, ops, repeats)
            rows.append(r)
            if log is not None:
                print(f"{n:>2} {_size(nbytes):>7} {r['capacity_rows']:>8} "
                      f"{_size(r['bytes_sent']):>8} {r['us_all_to_all_v']:>9.2f} "
                      f"{r['us_padded']:>9.2f} {r['us_plain']:>9.2f} "
                      f"{r['ratio_v_plain']:>7.2f} {r['pack_unpack_us']:>11.2f}"
                      f"{'' if r['timing_v'] == 'graph' else '  (a2a_v eager)'}"
                      f"{'  WRONG' if r['status'] != 'ok' else ''}", file=log, flush=True)
    from purlin.bench.sweep import environment

    try:
        env = environment(datapath="sm")
    except Exception as exc:  # noqa: BLE001 - the table stands without it
        env = {"environment": f"unavailable: {exc}"}
    return {"rows": rows, "info": {**env, "ranks": list(ranks), "sizes": list(sizes),
                                   "dtype": dtype, "row": row, "skew": "1 pair in 8 at 4x "
                                   "the average (= capacity)", "seconds":
                                   round(time.monotonic() - t0, 1),
                                   "measured": "CUDA-graph replay, device time per op "
                                               "(median)"}}


def main(argv=None) -> int:
    from purlin.bench.scripts import gpu_env, output, write_json
    from purlin.cli import size_list

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--sizes", default=None, help="8KiB:64MiB (powers of two) or a list; "
                    "default 8 KiB to 32 MiB by 4x, and 64 MiB")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--row", type=int, default=64, help="elements per row (a count unit)")
    ap.add_argument("--protocol", default="auto", choices=("auto", "simple", "ll", "fused"),
                    help="auto: strategy='auto' picks (default); else direct-push on it")
    ap.add_argument("--out", default=None, help="a folder (default outputs/) or a .json file")
    args = ap.parse_args(argv)
    gpu_env()
    sizes = size_list(args.sizes) if args.sizes else list(SIZES)
    out = run([int(x) for x in args.ranks.split(",")], sizes, args.dtype, args.row,
              args.protocol)
    path = write_json(output(args.out, "all_to_all_v.json"), out)
    print(f"wrote {path}")
    return 1 if any(r["status"] != "ok" for r in out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
