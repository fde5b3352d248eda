"""purlin.torch (one process per GPU) against NCCL: correctness, graphs, latency, the norm.

    python3 bench/process_mode.py [--out outputs/process_mode.json]   # 2 GPUs, ~2-4 minutes

Spawns one process per GPU (torch.multiprocessing, NCCL, the sm datapath on PyTorch symmetric
memory) and checks, for bf16 / fp16 / fp32 and message sizes 16 B .. 256 MiB (nccl-tests
convention: the largest per-rank buffer), that every function -- all_reduce (sum, max, avg),
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, broadcast, reduce -- gives
exactly NCCL's result (integer-valued data, so every sum is exact in every dtype), twice per
size with new data, and notes any fallback. Then:

* graph:   comm.all_reduce captured in a CUDA graph (after one eager call), replayed 100 times
           with new inputs copied in before each replay; every result compared with NCCL's;
* latency: all_reduce bf16 per op from CUDA-graph replays (20 ops per graph), Purlin vs NCCL,
           and the wall time per eager call up to 1 MiB;
* norm:    all_reduce_add_rms_norm against NCCL + the same add and norm in PyTorch, per dtype
           and [rows, hidden] (fused where the kernel can end with the epilogue), under a
           graph, and timed against its unfused equivalents;
* timeout: rank 1 skips a call; rank 0's check() must raise PurlinTimeoutError naming rank 1.

Prints tables and writes ``<out>/process_mode.json`` (``--out`` may name a .json file).
``--protocol`` picks the communicator's protocol (its default ``auto``: each size's from the
tuning table; ``simple``: the interpreter with flags; ``ll``: messages up to 256 KiB as LL;
``fused`` / ``fused-ll``: the fused kernel where it can run the plan); ``--zero-copy`` runs on one that skips the copies in and out where the plan
allows. The latency rows name what each size ran (``Communicator.plans``).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings

from purlin.bench.scripts import gpu_env, missing_gpus, output, write_json

gpu_env()  # before the ranks' processes start NCCL

KiB, MiB = 1 << 10, 1 << 20
DTYPES = ("bfloat16", "float16", "float32")
FUNCTIONS = ("all_reduce:sum", "all_reduce:max", "all_reduce:avg", "all_gather", "reduce_scatter",
             "all_to_all", "broadcast", "reduce")


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _data(torch, rank, salt, count, dtype, device):
    gen = torch.Generator(device=device).manual_seed(7919 * salt + 31 * rank + count)
    return torch.randint(-8, 9, (count,), generator=gen, device=device).to(dtype)


def check_function(torch, dist, comm, fn, nbytes, dtype, rank, n, device, salt):
    """Wrong elements of Purlin's result against NCCL's for one call (-1: not applicable)."""
    item = torch.empty((), dtype=dtype).element_size()
    count = nbytes // item
    R = dist.ReduceOp
    name, _, op = fn.partition(":")
    if name == "all_reduce":
        if count < 1:
            return -1
        x = _data(torch, rank, salt, count, dtype, device)
        ref = x.clone()
        rop = getattr(R, op.upper())
        dist.all_reduce(ref, op=rop)
        comm.all_reduce(x, op=rop)
        return int((x != ref).sum())
    if name == "all_gather":
        part = count // n
        if part < 1:
            return -1
        inp = _data(torch, rank, salt, part, dtype, device)
        out = torch.full((part * n,), 99, dtype=dtype, device=device)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, inp)
        comm.all_gather_into_tensor(out, inp)
        return int((out != ref).sum())
    if name == "reduce_scatter":
        part = count // n
        if part < 1:
            return -1
        inp = _data(torch, rank, salt, part * n, dtype, device)
        out = torch.full((part,), 99, dtype=dtype, device=device)
        ref = torch.empty_like(out)
        dist.reduce_scatter_tensor(ref, inp)
        comm.reduce_scatter_tensor(out, inp)
        return int((out != ref).sum())
    if name == "all_to_all":
        part = count // n
        if part < 1:
            return -1
        inp = _data(torch, rank, salt, part * n, dtype, device)
        out = torch.full_like(inp, 99)
        ref = torch.empty_like(inp)
        dist.all_to_all_single(ref, inp)
        comm.all_to_all_single(out, inp)
        return int((out != ref).sum())
    if count < 1:
        return -1
    root = salt % n
    t = _data(torch, rank, salt, count, dtype, device)
    ref = t.clone()
    if name == "broadcast":
        dist.broadcast(ref, src=root)
        comm.broadcast(t, src=root)
    else:
        dist.reduce(ref, dst=root)
        comm.reduce(t, dst=root)
    return int((t != ref).sum())


def correctness(torch, dist, comm, rank, n, device, opts):
    rows = []
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for nbytes in opts["sizes"]:
            for fn in FUNCTIONS:
                wrong, err = 0, None
                t0 = time.perf_counter()
                try:
                    for salt in range(2):
                        w = check_function(torch, dist, comm, fn, nbytes, dtype, rank, n, device,
                                           salt)
                        if w < 0:
                            wrong = -1
                            break
                        wrong += w
                    torch.cuda.synchronize()
                    comm.check()
                except Exception:  # noqa: BLE001 - record and go on
                    err = traceback.format_exc(limit=4)
                rows.append({"function": fn, "dtype": dtype_name, "nbytes": nbytes,
                             "wrong": wrong, "error": err,
                             "seconds": time.perf_counter() - t0})
                if err and "failed earlier" in err:
                    return rows
    return rows


def graph_check(torch, dist, comm, rank, n, device, opts):
    """Capture comm.all_reduce, replay with new inputs, compare each result with NCCL's."""
    out = []
    for nbytes in (8 * KiB, 1 * MiB, 32 * MiB):
        dtype = torch.bfloat16
        count = nbytes // 2
        static = _data(torch, rank, 0, count, dtype, device)
        comm.all_reduce(static)  # the eager first call prepares this size
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce(static)
        wrong = 0
        for i in range(opts["replays"]):
            x = _data(torch, rank, i + 1, count, dtype, device)
            ref = x.clone()
            dist.all_reduce(ref)
            static.copy_(x)
            graph.replay()
            wrong += int((static != ref).sum())
        torch.cuda.synchronize()
        comm.check()
        out.append({"nbytes": nbytes, "replays": opts["replays"], "wrong": wrong})
    return out


def _time_graph(torch, dist, fn, ops, repeats):
    """Median per-op microseconds of ``fn`` replayed from a CUDA graph (shared with the
    baselines' timing, so Purlin and NCCL are measured the same way)."""
    from purlin.bench.torch_dist import graph_per_op_us

    per_op = sorted(graph_per_op_us(torch, fn, ops, repeats, dist))
    return per_op[len(per_op) // 2]


def _time_eager(torch, dist, fn, calls):
    """Wall time per call of ``calls`` back-to-back eager calls (host cost included)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def latency(torch, dist, comm, rank, n, device, opts):
    rows = []
    for nbytes in opts["latency_sizes"]:
        x = _data(torch, rank, 0, nbytes // 2, torch.bfloat16, device)
        ops = 20 if nbytes <= 4 * MiB else 5
        purlin_us = _time_graph(torch, dist, lambda: comm.all_reduce(x), ops, 5)
        nccl_us = _time_graph(torch, dist, lambda: dist.all_reduce(x), ops, 5)
        eager = [_time_eager(torch, dist, fn, 200) if nbytes <= MiB else float("nan")
                 for fn in (lambda: comm.all_reduce(x), lambda: dist.all_reduce(x))]
        t = torch.tensor([purlin_us, nccl_us] + eager, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ran = next((p for p in comm.plans() if p["function"] == "all-reduce"
                    and p["count"] == x.numel() and p["dtype"] == "bfloat16"), {})
        rows.append({"nbytes": nbytes, "purlin_us": t[0].item(), "nccl_us": t[1].item(),
                     "purlin_eager_us": t[2].item(), "nccl_eager_us": t[3].item(),
                     "ran": {k: ran.get(k) for k in ("strategy", "chunks", "lanes", "protocol",
                                                     "pdl", "blocks_per_lane")}})
    torch.cuda.synchronize()
    comm.check()
    return rows


NORM_SHAPES = ((1, 4096), (8, 4096), (64, 4096), (1, 8192), (32, 8192), (2048, 4096), (3, 1000))


def norm_check(torch, dist, comm, rank, n, device, opts):
    """``comm.all_reduce_add_rms_norm`` against NCCL's all-reduce and then the same add and
    norm in PyTorch (``purlin.torch.comm.add_rms_norm``), per dtype and [rows, hidden]: the
    residual must be equal, the norm within a rounding, and the same bits on every rank;
    then captured in a CUDA graph and replayed with new inputs; and timed (graph replays)
    against NCCL + add + ``torch.rms_norm`` and Purlin's plain all-reduce + the same."""
    from purlin.torch.comm import add_rms_norm

    out = []
    eps = 1e-5
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        for rows, hidden in NORM_SHAPES:
            row = {"dtype": dtype_name, "rows": rows, "hidden": hidden}
            try:
                gen = torch.Generator(device=device).manual_seed(rows * 7 + hidden)
                weight = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(dtype)
                residual = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
                wrong_r = wrong_y = 0
                same = True
                for salt in range(2):
                    g = torch.Generator(device=device).manual_seed(salt * 100 + rank)
                    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
                    ref, ref_r = x.clone(), residual.clone()
                    dist.all_reduce(ref)
                    add_rms_norm(ref, ref_r, weight, eps)
                    t, r = x.clone(), residual.clone()
                    comm.all_reduce_add_rms_norm(t, r, weight, eps)
                    wrong_r += int((r != ref_r).sum())
                    far = (t.float() - ref.float()).abs() > tol * (1 + ref.float().abs())
                    wrong_y += int(far.sum())
                    theirs = t.clone()
                    dist.broadcast(theirs, src=0)
                    same &= bool(torch.equal(theirs, t))
                torch.cuda.synchronize()
                comm.check()
                ran = next((p for p in comm.plans() if p["function"] ==
                            "all-reduce-add-rms-norm" and p["count"] == rows * hidden
                            and p["dtype"] == dtype_name), {})
                row.update(wrong_residual=wrong_r, wrong_norm=wrong_y, ranks_equal=same,
                           fused=bool(ran.get("epilogues")), protocol=ran.get("protocol"),
                           kernel=ran.get("norm_kernel"))
                if dtype == torch.bfloat16 and rows * hidden <= 1 << 20:
                    row.update(_norm_graph(torch, dist, comm, rank, rows, hidden, weight, eps,
                                           tol, device, opts))
            except Exception:  # noqa: BLE001 - record and go on
                row["error"] = traceback.format_exc(limit=6)
            out.append(row)
    return out


def _norm_graph(torch, dist, comm, rank, rows, hidden, weight, eps, tol, device, opts):
    """Replays of a captured all_reduce_add_rms_norm (new inputs each time, checked), then
    per-op graph times of it and of its unfused equivalents."""
    from purlin.torch.comm import add_rms_norm

    t = torch.zeros(rows, hidden, dtype=weight.dtype, device=device)
    r = torch.zeros_like(t)
    comm.all_reduce_add_rms_norm(t, r, weight, eps)  # the eager first call: its program
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce_add_rms_norm(t, r, weight, eps)
    wrong = 0
    for i in range(opts["replays"] // 4):
        g = torch.Generator(device=device).manual_seed(1000 + i * 10 + rank)
        x = torch.randn(rows, hidden, generator=g, device=device).to(t.dtype)
        r0 = torch.randn(rows, hidden, generator=torch.Generator(device=device).manual_seed(i),
                         device=device).to(t.dtype)
        ref, ref_r = x.clone(), r0.clone()
        dist.all_reduce(ref)
        add_rms_norm(ref, ref_r, weight, eps)
        t.copy_(x)
        r.copy_(r0)
        graph.replay()
        wrong += int((r != ref_r).sum())
        wrong += int(((t.float() - ref.float()).abs() > tol * (1 + ref.float().abs())).sum())
    torch.cuda.synchronize()
    comm.check()
    r.zero_()
    t.normal_()

    def nccl():
        dist.all_reduce(t)
        r.add_(t)
        return torch.rms_norm(r, (hidden,), weight, eps)

    def plain():
        comm.all_reduce(t)
        r.add_(t)
        return torch.rms_norm(r, (hidden,), weight, eps)

    times = [_time_graph(torch, dist, fn, 20, 5) for fn in (
        lambda: comm.all_reduce_add_rms_norm(t, r, weight, eps), plain, nccl)]
    peak = torch.tensor(times, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"graph_wrong": wrong, "graph_replays": opts["replays"] // 4,
            "fused_us": peak[0].item(), "purlin_plain_us": peak[1].item(),
            "nccl_us": peak[2].item()}


def timeout_check(torch, dist, rank, n, device, protocol="auto"):
    from purlin.errors import PurlinTimeoutError
    from purlin.torch import Communicator

    comm = Communicator(staging_bytes=16 * MiB, timeout=1.0, protocol=protocol)
    x = torch.ones(1024, device=device)
    comm.all_reduce(x)  # prepared and in step
    torch.cuda.synchronize()
    result = {"raised": None, "seconds": None}
    if rank == 0:
        t0 = time.perf_counter()
        comm.all_reduce(x)  # rank 1 never joins this call
        torch.cuda.synchronize()
        try:
            comm.check()
        except PurlinTimeoutError as exc:
            result["raised"] = str(exc)
        result["seconds"] = time.perf_counter() - t0
    dist.barrier()
    return result


def worker(rank, n, opts):
    import torch
    import torch.distributed as dist

    from purlin.torch import Communicator

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda", torch.cuda.current_device())
    report = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        t0 = time.perf_counter()
        comm = Communicator(staging_bytes=opts["staging"], timeout=10.0,
                            protocol=opts.get("protocol", "auto"),
                            zero_copy=opts.get("zero_copy", False))
        report["setup_s"] = time.perf_counter() - t0
        for section, fn in (("correctness", correctness), ("graph", graph_check),
                            ("latency", latency), ("norm", norm_check)):
            if section not in opts["sections"]:
                continue
            try:
                report[section] = fn(torch, dist, comm, rank, n, device, opts)
            except Exception:  # noqa: BLE001
                report[section] = {"error": traceback.format_exc(limit=6)}
        report["evictions"] = comm.evictions
        report["fallbacks"] = sorted({str(w.message) for w in caught
                                      if "falls back" in str(w.message)})
    if "timeout" in opts["sections"]:
        try:
            report["timeout"] = timeout_check(torch, dist, rank, n, device,
                                              opts.get("protocol", "auto"))
        except Exception:  # noqa: BLE001
            report["timeout"] = {"error": traceback.format_exc(limit=6)}
    return report


def human(nbytes: int) -> str:
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def print_report(reports) -> bool:
    ok = True
    r0 = reports[0]
    print(f"setup (symmetric memory rendezvous): {r0.get('setup_s', float('nan')):.2f} s")
    rows = {}
    for rep in reports:
        corr = rep.get("correctness")
        if isinstance(corr, dict):
            print(f"rank {rep['rank']} correctness failed:\n{corr['error']}")
            ok = False
            continue
        for row in corr or []:
            key = (row["dtype"], row["nbytes"], row["function"])
            prev = rows.get(key)
            if prev is None or row["error"] or row["wrong"] > 0:
                rows[key] = row
    if rows:
        print("\ncorrectness against NCCL (wrong elements over 2 calls; '-' not applicable)")
        print(f"{'dtype':>9} {'size':>9} " + " ".join(f"{f:>15}" for f in FUNCTIONS))
        for dtype in DTYPES:
            for nbytes in sorted({k[1] for k in rows}):
                cells = []
                for fn in FUNCTIONS:
                    row = rows.get((dtype, nbytes, fn))
                    if row is None:
                        cells.append("?")
                    elif row["error"]:
                        cells.append("ERROR")
                        ok = False
                    elif row["wrong"] < 0:
                        cells.append("-")
                    else:
                        cells.append(str(row["wrong"]))
                        ok &= row["wrong"] == 0
                print(f"{dtype:>9} {human(nbytes):>9} " + " ".join(f"{c:>15}" for c in cells))
        errors = [r for r in rows.values() if r["error"]]
        for r in errors[:3]:
            print(f"\n{r['function']} {r['dtype']} {human(r['nbytes'])}:\n{r['error']}")
    for rep in reports:
        g = rep.get("graph")
        if isinstance(g, dict):
            print(f"rank {rep['rank']} graph check failed:\n{g['error']}")
            ok = False
        elif g:
            print(f"rank {rep['rank']} graph replays: " + ", ".join(
                f"{human(x['nbytes'])}: {x['wrong']} wrong in {x['replays']}" for x in g))
            ok &= all(x["wrong"] == 0 for x in g)
    lat = r0.get("latency")
    if isinstance(lat, dict):
        print(f"latency failed:\n{lat['error']}")
        ok = False
    elif lat:
        print("\nall_reduce bf16 per op (us; slowest rank): CUDA graph replays, and eager calls "
              "(host cost included)")
        print(f"{'size':>9} {'purlin':>9} {'nccl':>9} {'speedup':>8} {'eager purlin':>13} "
              f"{'eager nccl':>11}  ran")
        for x in lat:
            ran = x.get("ran", {})
            print(f"{human(x['nbytes']):>9} {x['purlin_us']:9.1f} {x['nccl_us']:9.1f} "
                  f"{x['nccl_us'] / x['purlin_us']:8.2f} {x['purlin_eager_us']:13.1f} "
                  f"{x['nccl_eager_us']:11.1f}  {ran.get('strategy')} c{ran.get('chunks')} "
                  f"l{ran.get('lanes')} b{ran.get('blocks_per_lane')} {ran.get('protocol')}"
                  f"{' pdl' if ran.get('pdl') else ''}")
    ok &= _print_norm(reports)
    t = r0.get("timeout")
    if t:
        print(f"\ntimeout: {t}")
        ok &= bool(t.get("raised")) and "rank 1" in t.get("raised", "")
    for rep in reports:
        if rep.get("fallbacks"):
            print(f"rank {rep['rank']} fallbacks: {rep['fallbacks']}")
        print(f"rank {rep['rank']} evictions: {rep.get('evictions')}")
    print("\nPASS" if ok else "\nFAIL")
    return ok


def _print_norm(reports) -> bool:
    """The all_reduce_add_rms_norm table (rank 0's rows; wrong counts summed over ranks)."""
    rows = reports[0].get("norm")
    if not rows:
        return True
    if isinstance(rows, dict):
        print(f"norm failed:\n{rows['error']}")
        return False
    ok = True
    print("\nall_reduce_add_rms_norm against NCCL + add + RMSNorm in PyTorch (wrong elements "
          "over 2 calls, both ranks; graph: replays with new inputs); bf16 per op (us, "
          "slowest rank): fused, Purlin all_reduce + add + torch.rms_norm, NCCL + the same")
    print(f"{'dtype':>9} {'rows x hidden':>14} {'fused':>5} {'resid':>5} {'norm':>5} "
          f"{'ranks=':>6} {'graph':>5} {'fused us':>8} {'plain us':>8} {'nccl us':>8} "
          f"{'x nccl':>6}")
    for i, row in enumerate(rows):
        if "error" in row:
            print(f"{row['dtype']:>9} {row['rows']}x{row['hidden']}: ERROR\n{row['error']}")
            ok = False
            continue
        wrong = [sum(rep["norm"][i].get(k, 0) for rep in reports if isinstance(
            rep.get("norm"), list)) for k in ("wrong_residual", "wrong_norm", "graph_wrong")]
        times = ""
        if "fused_us" in row:
            times = (f"{row['fused_us']:8.2f} {row['purlin_plain_us']:8.2f} "
                     f"{row['nccl_us']:8.2f} {row['nccl_us'] / row['fused_us']:6.2f}")
        graph = str(wrong[2]) if "graph_wrong" in row else "-"
        print(f"{row['dtype']:>9} {str(row['rows']) + 'x' + str(row['hidden']):>14} "
              f"{'yes' if row['fused'] else 'no':>5} {wrong[0]:>5} {wrong[1]:>5} "
              f"{'yes' if row['ranks_equal'] else 'NO':>6} {graph:>5} {times} "
              f"{row.get('kernel') or ''}")
        ok &= wrong == [0, 0, 0] and row["ranks_equal"]
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-bytes", type=int, default=256 * MiB)
    ap.add_argument("--staging", type=int, default=2560 * MiB)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--sections", default="correctness,graph,latency,norm,timeout")
    ap.add_argument("--protocol", default="auto",
                    choices=("simple", "ll", "fused", "fused-ll", "auto"),
                    help="the communicator's protocol (ll: flags inside the data, <= 256 KiB; "
                         "fused*: the fused kernel where it can; auto: the tuning table's)")
    ap.add_argument("--zero-copy", action="store_true",
                    help="the communicator reads / writes the caller's tensors where no peer "
                         "needs them (no copy in or out)")
    args = ap.parse_args(argv)
    why = missing_gpus(args.world, "bench/process_mode.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    from purlin.torch.testing import run_processes

    opts = {"sizes": sizes(16, args.max_bytes) + [14, 6 * KiB + 6, 3 * MiB + 2],
            "latency_sizes": [s for s in (8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB)
                              if s <= args.max_bytes],
            "staging": args.staging, "replays": args.replays, "protocol": args.protocol,
            "zero_copy": args.zero_copy,
            "sections": set(args.sections.split(","))}
    t0 = time.time()
    outcomes = run_processes(worker, args.world, opts, backend="nccl", timeout=540,
                             pg_timeout=120)
    reports = []
    for rank, (status, value) in enumerate(outcomes):
        if status != "ok":
            print(f"rank {rank} {status}: {value}")
            reports.append({"rank": rank, "failed": str(value)})
        else:
            reports.append(value)
    ok = print_report(reports) and all(s == "ok" for s, _ in outcomes)
    path = write_json(output(args.out, "process_mode.json"),
                      {"ok": ok, "seconds": time.time() - t0, "reports": reports})
    print(f"wrote {path} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
