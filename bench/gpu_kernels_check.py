"""Check the executor kernel on two GPUs with hand-built tables, and time it.

    PYTHONPATH=. python3 bench/gpu_kernels_check.py --out $OUT

Needs 2 peer-capable GPUs, PyTorch (buffers, streams, CUDA graphs) and numba-cuda. Sections:

1. copy      -- COPY from GPU 0 into GPU 1's memory, 16 B .. 256 MiB (and misaligned), exact;
2. allreduce -- a 2-rank one-shot push all-reduce (copy into the peer's scratch, notify, wait,
                reduce own input + scratch; an ack flag guards the scratch across calls) in
                bf16 / fp32: 1000 back-to-back calls, and 50 calls with inputs changing between
                calls (every call's output checked), all exact against torch;
3. graphs    -- per-op latency from CUDA-graph replays (torch.cuda.CUDAGraph per device);
4. eager     -- host time per eager call (two Launcher calls) and per single launch;
5. timeout   -- a wait nobody notifies times out within its limit and leaves the error record;
                the other GPU's rank sees ABORT and leaves with ERR_ABORTED;
6. trace     -- one traced all-reduce: per-row durations from %globaltimer.

Prints short tables and writes everything to ``<out>/gpu_kernels_check.json`` (``--out`` may
also name a .json file). Each section catches its own failure and records it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

from purlin.kernels import isa, sim  # noqa: E402  (sim: host-side table builders only)

KiB, MiB = 1 << 10, 1 << 20
DTYPE_NAMES = {code: name for name, code in isa.DTYPE_CODES.items()}
TIMEOUT_NS = 10_000_000_000


# ------------------------------------------------------------------------------------ set-up


def enable_peer_access(ndev: int = 2) -> dict:
    """Enable peer access both ways through Numba's context API (mandatory before a kernel
    touches peer memory: without it the access faults and the context dies)."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    contexts = []
    for d in range(ndev):
        with cuda.gpus[d]:
            contexts.append(cuda.current_context())
    status = {}
    for a in range(ndev):
        for b in range(ndev):
            if a == b:
                continue
            with cuda.gpus[a]:
                if not contexts[a].can_access_peer(b):
                    raise RuntimeError(f"GPU {a} cannot access GPU {b} as a peer")
                try:
                    contexts[a].enable_peer_access(contexts[b].handle)
                    status[f"{a}->{b}"] = "enabled"
                except CudaAPIError as exc:
                    if int(exc.code) != 704:  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        raise
                    status[f"{a}->{b}"] = "already enabled"
    return status


_LAUNCHERS: dict = {}


def launcher(dev: int, nlanes: int, bpl: int, threads: int = 512):
    from purlin.kernels.launch import Launcher

    key = (dev, nlanes, bpl, threads)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = Launcher(dev, 1, nlanes, bpl, threads)
    return _LAUNCHERS[key]


class DeviceRank:
    """One rank's table, pool, counters, error record and trace in GPU memory (torch)."""

    def __init__(self, torch, rank: int, dev: int, lanes, abort, trace_rows: int = 0,
                 blocks_per_lane: int = 1):
        device = torch.device("cuda", dev)
        table, offsets, pool = sim.build_table(lanes)
        self.table = torch.from_numpy(table).to(device)
        self.offsets = torch.from_numpy(offsets).to(device)
        self.pool = torch.from_numpy(pool).to(device)
        self.control = torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64, device=device)
        nblocks = max(len(lanes), 1) * blocks_per_lane
        self.trace = (torch.full((nblocks, trace_rows, isa.TRACE_WIDTH), -1, dtype=torch.int64,
                                 device=device) if trace_rows else None)
        ctl = self.control.data_ptr()
        desc = sim.descriptor(rank, self.table.data_ptr(), self.offsets.data_ptr(), len(lanes),
                              self.pool.data_ptr(), ctl, ctl + 8, ctl + 16, abort.data_ptr(),
                              self.trace.data_ptr() if trace_rows else 0, trace_rows)
        self.desc = torch.from_numpy(desc).to(device)
        self.desc_ptr = self.desc.data_ptr()
        self.dev = dev

    def error(self) -> dict:
        return sim.error_record(self.control[2:].cpu().numpy())

    def epoch(self) -> int:
        return int(self.control[0].item())


def config_for(nbytes: int) -> tuple[int, int]:
    """(lanes, blocks per lane): few blocks for small messages, 128 for large ones."""
    if nbytes <= MiB:
        return 1, max(1, min(16, nbytes // (16 * KiB)))
    return 8, 16


# ----------------------------------------------------------------------------- all-reduce


class AllReducePair:
    """A 2-rank one-shot push all-reduce as hand-built tables (rank r on GPU r).

    Per lane, rank r runs: WAIT ack (the peer finished reading the scratch r wrote last call),
    COPY input -> peer scratch, NOTIFY peer, WAIT data flag, REDUCE input + scratch -> output,
    NOTIFY the peer's ack flag.
    """

    def __init__(self, torch, n: int, dtype, nlanes: int, bpl: int, trace_rows: int = 0):
        code = {torch.bfloat16: isa.BF16, torch.float32: isa.F32}[dtype]
        item = torch.tensor([], dtype=dtype).element_size()
        self.torch, self.n, self.dtype, self.nlanes, self.bpl = torch, n, dtype, nlanes, bpl
        devs = [torch.device("cuda", r) for r in (0, 1)]
        gen = torch.Generator(device="cpu").manual_seed(n)
        self.inp = [(torch.randn(n, generator=gen) * 4).to(dtype).to(d) for d in devs]
        self.scratch = [torch.zeros(n, dtype=dtype, device=d) for d in devs]
        self.out = [torch.zeros(n, dtype=dtype, device=d) for d in devs]
        self.flags = [torch.zeros(2 * nlanes, dtype=torch.int64, device=d) for d in devs]
        self.abort = torch.zeros(1, dtype=torch.int64, device=devs[0])
        chunk = math.ceil(math.ceil(n / nlanes) / 8) * 8  # 16-byte aligned chunks (bf16)
        data = [[f.data_ptr() + 8 * lane for lane in range(nlanes)] for f in self.flags]
        ack = [[f.data_ptr() + 8 * (nlanes + lane) for lane in range(nlanes)] for f in self.flags]
        self.ranks = []
        for r in (0, 1):
            p = 1 - r
            lanes = []
            for lane in range(nlanes):
                lo = lane * chunk
                cnt = min(chunk, n - lo)
                if cnt <= 0:
                    lanes.append([])
                    continue
                off = lo * item
                lanes.append([
                    sim.wait_row(ack[r][lane], bpl, bpl, epoch_offset=-1, step=0, peer=p),
                    sim.copy_row(self.scratch[p].data_ptr() + off, self.inp[r].data_ptr() + off,
                                 cnt, dtype=code, step=1, peer=p),
                    sim.notify_row(data[p][lane], 1, step=2, peer=p),
                    sim.wait_row(data[r][lane], bpl, bpl, step=3, peer=p),
                    sim.reduce_row(self.out[r].data_ptr() + off,
                                   [self.inp[r].data_ptr() + off,
                                    self.scratch[r].data_ptr() + off],
                                   cnt, dtype=code, redop=isa.SUM, step=4, peer=p),
                    sim.notify_row(ack[p][lane], 1, step=5, peer=p),
                ])
            self.ranks.append(DeviceRank(torch, r, r, lanes, self.abort, trace_rows, bpl))
        self.launchers = [launcher(r, nlanes, bpl) for r in (0, 1)]
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    def launch(self, streams, timeout_ns: int = TIMEOUT_NS) -> None:
        for r in (0, 1):
            self.launchers[r](self.ranks[r].desc_ptr, streams[r].cuda_stream, timeout_ns)

    def expected(self, inp0=None, inp1=None):
        """Both ranks' expected output, on GPU 0: float32 sum rounded once (like the kernel)."""
        a = self.inp[0] if inp0 is None else inp0
        b = (self.inp[1] if inp1 is None else inp1).to(a.device)
        return (a.float() + b.float()).to(self.dtype)

    def errors(self) -> list[dict]:
        return [rank.error() for rank in self.ranks]

    def check(self, want=None) -> dict:
        torch = self.torch
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        want = self.expected() if want is None else want
        ok = [bool(torch.equal(self.out[r].to(want.device), want)) for r in (0, 1)]
        return {"exact": all(ok), "errors": [e["code"] for e in self.errors()],
                "epochs": [rank.epoch() for rank in self.ranks]}


def sync_all(torch) -> None:
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


# ---------------------------------------------------------------------------------- sections


def section_copy(torch) -> dict:
    """COPY from GPU 0 into GPU 1, exact, plus bandwidth on the large sizes."""
    rows = []
    big = 256 * MiB
    src = torch.randint(0, 256, (big + 64,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((big + 64,), 0xA5, dtype=torch.uint8, device="cuda:1")
    abort = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    stream = torch.cuda.Stream(device=0)
    cases = [(s, isa.F32, 0, 0) for s in (16, 256, 4 * KiB, 64 * KiB, MiB, 16 * MiB, big)]
    cases += [(1000002, isa.BF16, 2, 6), (1000004, isa.F32, 4, 4), (33 * 16 + 6, isa.BF16, 10, 0)]
    for nbytes, code, s_off, d_off in cases:
        item = isa.ITEMSIZE[code]
        count = nbytes // item
        dst.fill_(0xA5)
        row = sim.copy_row(dst.data_ptr() + 16 + d_off, src.data_ptr() + 16 + s_off, count,
                           dtype=code)
        lanes, bpl = 1, 128
        rank = DeviceRank(torch, 0, 0, [[row]], abort, blocks_per_lane=bpl)
        run = launcher(0, lanes, bpl)
        sync_all(torch)
        run(rank.desc_ptr, stream.cuda_stream)
        sync_all(torch)
        got = dst[16 + d_off: 16 + d_off + nbytes].cpu()
        want = src[16 + s_off: 16 + s_off + nbytes].cpu()
        exact = bool(torch.equal(got, want))
        before = bool((dst[: 16 + d_off].cpu() == 0xA5).all())
        after = bool((dst[16 + d_off + nbytes: 16 + d_off + nbytes + 32].cpu() == 0xA5).all())
        gbps = None
        if nbytes >= 16 * MiB:
            reps = 5
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            for _ in range(reps):
                run(rank.desc_ptr, stream.cuda_stream)
            end.record(stream)
            end.synchronize()
            gbps = nbytes * reps / (start.elapsed_time(end) * 1e-3) / 1e9
        rows.append({"bytes": nbytes, "dtype": DTYPE_NAMES[code], "src_off": s_off,
                     "dst_off": d_off, "exact": exact, "guards_intact": before and after,
                     "error": rank.error()["code"], "GB/s": gbps})
    print("\n[1] copy GPU0 -> GPU1 (1 lane x 128 blocks x 512 threads)")
    print(f"{'bytes':>12} {'offs':>6} {'exact':>6} {'guards':>7} {'GB/s':>8}")
    for r in rows:
        bw = f"{r['GB/s']:.1f}" if r["GB/s"] else "-"
        print(f"{r['bytes']:>12} {r['src_off']:>2},{r['dst_off']:<3} {str(r['exact']):>6} "
              f"{str(r['guards_intact']):>7} {bw:>8}")
    return {"rows": rows, "ok": all(r["exact"] and r["guards_intact"] and r["error"] == 0
                                    for r in rows)}


def section_allreduce(torch, streams) -> dict:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for nbytes in (8 * KiB, MiB, 16 * MiB):
            item = torch.tensor([], dtype=dtype).element_size()
            nlanes, bpl = config_for(nbytes)
            pair = AllReducePair(torch, nbytes // item, dtype, nlanes, bpl)
            start = time.perf_counter()
            for _ in range(1000):
                pair.launch(streams)
            result = pair.check()
            result["seconds_1000_calls"] = time.perf_counter() - start
            result.update(dtype=str(dtype), bytes=nbytes, lanes=nlanes, blocks_per_lane=bpl,
                          test="1000 calls")
            rows.append(result)
    # inputs change between calls; every call's output is kept and checked
    for dtype in (torch.bfloat16, torch.float32):
        nbytes = MiB
        item = torch.tensor([], dtype=dtype).element_size()
        nlanes, bpl = config_for(nbytes)
        pair = AllReducePair(torch, nbytes // item, dtype, nlanes, bpl)
        calls = 50
        hin = [[None] * calls for _ in (0, 1)]
        hout = [[None] * calls for _ in (0, 1)]
        for i in range(calls):
            for r in (0, 1):
                with torch.cuda.stream(streams[r]):
                    pair.inp[r].mul_(-1).add_(i % 7)
                    hin[r][i] = pair.inp[r].clone()
            pair.launch(streams)
            for r in (0, 1):
                with torch.cuda.stream(streams[r]):
                    hout[r][i] = pair.out[r].clone()
        sync_all(torch)
        bad = []
        for i in range(calls):
            want = pair.expected(hin[0][i], hin[1][i])
            for r in (0, 1):
                if not torch.equal(hout[r][i].to(want.device), want):
                    bad.append((i, r))
        rows.append({"dtype": str(dtype), "bytes": nbytes, "lanes": nlanes,
                     "blocks_per_lane": bpl, "test": f"{calls} calls, changing inputs",
                     "exact": not bad, "bad_calls": bad[:10],
                     "errors": [e["code"] for e in pair.errors()],
                     "epochs": [rank.epoch() for rank in pair.ranks]})
    print("\n[2] one-shot push all-reduce, 2 ranks, exact vs torch")
    print(f"{'dtype':>15} {'bytes':>10} {'lanes x bpl':>11} {'test':>28} {'exact':>6} "
          f"{'errors':>7} {'epochs':>11}")
    for r in rows:
        print(f"{r['dtype']:>15} {r['bytes']:>10} {r['lanes']:>5} x {r['blocks_per_lane']:<3} "
              f"{r['test']:>28} {str(r['exact']):>6} {str(r['errors']):>7} "
              f"{str(r['epochs']):>11}")
    ok = all(r["exact"] and r["errors"] == [0, 0] for r in rows)
    return {"rows": rows, "ok": ok}


def section_graphs(torch, streams) -> dict:
    """Per-op latency from CUDA-graph replays: one graph per device, K launches each."""
    rows = []
    for nbytes in (8 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB):
        dtype = torch.bfloat16
        nlanes, bpl = config_for(nbytes)
        pair = AllReducePair(torch, nbytes // 2, dtype, nlanes, bpl)
        ops = 20 if nbytes <= MiB else (10 if nbytes <= 16 * MiB else 3)
        reps = 20 if nbytes <= MiB else (5 if nbytes <= 16 * MiB else 3)
        for _ in range(5):
            pair.launch(streams)
        sync_all(torch)
        graphs = []
        for r in (0, 1):
            with torch.cuda.device(r):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=streams[r]):
                    for _ in range(ops):
                        pair.launchers[r](pair.ranks[r].desc_ptr, streams[r].cuda_stream,
                                          TIMEOUT_NS)
                graphs.append(graph)
        sync_all(torch)
        events = []
        for r in (0, 1):
            with torch.cuda.device(r):
                events.append((torch.cuda.Event(enable_timing=True),
                               torch.cuda.Event(enable_timing=True)))
        for r in (0, 1):
            events[r][0].record(streams[r])
        for _ in range(reps):
            for r in (0, 1):
                with torch.cuda.device(r), torch.cuda.stream(streams[r]):
                    graphs[r].replay()
        for r in (0, 1):
            events[r][1].record(streams[r])
        sync_all(torch)
        ms = max(events[r][0].elapsed_time(events[r][1]) for r in (0, 1))
        us = ms * 1e3 / (ops * reps)
        result = pair.check()
        rows.append({"bytes": nbytes, "dtype": "bfloat16", "lanes": nlanes,
                     "blocks_per_lane": bpl, "us_per_op": us,
                     "busbw_GBps": nbytes / (us * 1e-6) / 1e9, **result})
        del graphs
    print("\n[3] all-reduce bf16, CUDA graph replays (NCCL on this machine: 9.8 / 10.3 / 16.7 "
          "/ 76.8 / 888 us)")
    print(f"{'bytes':>10} {'lanes x bpl':>11} {'us/op':>9} {'busbw GB/s':>11} {'exact':>6}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['lanes']:>5} x {r['blocks_per_lane']:<3} "
              f"{r['us_per_op']:>9.1f} {r['busbw_GBps']:>11.1f} {str(r['exact']):>6}")
    return {"rows": rows, "ok": all(r["exact"] and r["errors"] == [0, 0] for r in rows)}


def section_eager(torch, streams) -> dict:
    """Host time of eager calls: two Launcher calls per all-reduce, and one bare launch."""
    pair = AllReducePair(torch, 8 * KiB // 2, torch.bfloat16, *config_for(8 * KiB))
    for _ in range(20):
        pair.launch(streams)
    sync_all(torch)
    calls = 500
    start = time.perf_counter()
    for _ in range(calls):
        pair.launch(streams)
    host = time.perf_counter() - start
    sync_all(torch)
    wall = time.perf_counter() - start
    result = pair.check()

    abort = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    empty = DeviceRank(torch, 0, 0, [[]], abort)
    run = launcher(0, 1, 1)
    stream = streams[0].cuda_stream
    sync_all(torch)
    for _ in range(20):
        run(empty.desc_ptr, stream)
    sync_all(torch)
    singles = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            run(empty.desc_ptr, stream)
        singles.append((time.perf_counter() - start) / 200 * 1e6)
        sync_all(torch)
    out = {"calls": calls, "host_us_per_call": host / calls * 1e6,
           "wall_us_per_call": wall / calls * 1e6, "single_launch_us_median":
           float(np.median(singles)), "single_launch_us_all": singles,
           "registers_per_thread": pair.launchers[0].registers, **result}
    print("\n[4] eager host time (target <= 15 us per launch; Numba's own launch was 42-56 us)")
    print(f"  all-reduce 8 KiB, 2 launches: host {out['host_us_per_call']:.1f} us/call, "
          f"wall {out['wall_us_per_call']:.1f} us/call, exact {out['exact']}")
    print(f"  one launch of an empty table: {out['single_launch_us_median']:.2f} us "
          f"(median of 5 x 200); executor registers/thread: {out['registers_per_thread']}")
    out["ok"] = result["exact"] and out["single_launch_us_median"] <= 15
    return out


def section_timeout(torch, streams) -> dict:
    """A wait nobody notifies: rank 0 (GPU 0, limit 100 ms) times out in both lanes; rank 1
    (GPU 1, limit 10 s) sees the shared ABORT word and leaves with ERR_ABORTED."""
    flags = [torch.zeros(4, dtype=torch.int64, device=f"cuda:{r}") for r in (0, 1)]
    abort = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    f0, f1 = flags[0].data_ptr(), flags[1].data_ptr()
    rank0 = DeviceRank(torch, 0, 0, [[sim.wait_row(f0, 1, 1, step=11, peer=1)],
                                     [sim.wait_row(f0 + 8, 1, 1, step=12, peer=1)]], abort,
                       blocks_per_lane=2)
    rank1 = DeviceRank(torch, 1, 1, [[sim.wait_row(f1, 5, 5, step=21, peer=0)]], abort,
                       blocks_per_lane=2)
    limit_ns = 100_000_000
    l0, l1 = launcher(0, 2, 2), launcher(1, 1, 2)
    sync_all(torch)
    start = time.perf_counter()
    l1(rank1.desc_ptr, streams[1].cuda_stream, TIMEOUT_NS)
    l0(rank0.desc_ptr, streams[0].cuda_stream, limit_ns)
    streams[0].synchronize()
    t0 = time.perf_counter() - start
    streams[1].synchronize()
    t1 = time.perf_counter() - start
    rec0, rec1 = rank0.error(), rank1.error()
    alive = bool((torch.ones(4, device="cuda:0") + 1).sum().item() == 8)
    ok = (rec0["code"] == isa.ERR_TIMEOUT and rec0["rank"] == 0 and rec0["step"] in (11, 12)
          and rec0["flag"] in (f0, f0 + 8) and rec0["expected"] == 1 and rec0["seen"] == 0
          and rec0["peer"] == 1 and rec1["code"] == isa.ERR_ABORTED and rec1["rank"] == 1
          and rec1["step"] == 21 and rec1["expected"] == 5 and int(abort.item()) >= 1
          and t0 < 1.0 and t1 < 2.0 and alive
          and rank0.epoch() == 1 and rank1.epoch() == 1)
    out = {"limit_s": limit_ns / 1e9, "rank0_done_s": t0, "rank1_done_s": t1, "rank0": rec0,
           "rank1": rec1, "abort": int(abort.item()), "context_alive": alive, "ok": ok}
    print("\n[5] timeout: rank 0 limit 0.1 s, rank 1 limit 10 s (should end by ABORT)")
    print(f"  rank 0 returned after {t0:.3f} s: {rec0}")
    print(f"  rank 1 returned after {t1:.3f} s: {rec1}")
    print(f"  ok: {ok}")
    return out


def section_trace(torch, streams) -> dict:
    """One traced 1 MiB bf16 all-reduce: rows, blocks and durations from the trace buffer."""
    nlanes, bpl = config_for(MiB)
    pair = AllReducePair(torch, MiB // 2, torch.bfloat16, nlanes, bpl, trace_rows=8)
    pair.launch(streams)
    result = pair.check()
    names = ["wait ack", "copy->peer", "notify", "wait data", "reduce", "notify ack"]
    trace = pair.ranks[0].trace.cpu().numpy()  # [blocks, rows, 4]
    per_row = []
    for i, name in enumerate(names):
        recs = trace[:, i, :]
        recs = recs[recs[:, 0] >= 0]
        durations = (recs[:, 3] - recs[:, 2]) / 1e3
        per_row.append({"row": i, "what": name, "blocks": int(len(recs)),
                        "mean_us": float(durations.mean()) if len(recs) else None,
                        "monotone": bool((recs[:, 3] >= recs[:, 2]).all())})
    print("\n[6] trace of one 1 MiB bf16 all-reduce, rank 0 (per row, over blocks)")
    for p in per_row:
        mean = f"{p['mean_us']:.2f}" if p["mean_us"] is not None else "-"
        print(f"  {p['row']} {p['what']:>11}: {p['blocks']} blocks, mean {mean} us")
    ok = result["exact"] and all(p["blocks"] == nlanes * bpl and p["monotone"] for p in per_row)
    return {"rows": per_row, "ok": ok, **result}


# ----------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder (or .json file) for the results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "gpu_kernels_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save():
        out.write_text(json.dumps(results, indent=1, default=str))

    if torch.cuda.device_count() < 2:
        results["fatal"] = f"needs 2 GPUs, found {torch.cuda.device_count()}"
        save()
        print(results["fatal"])
        return 2
    from importlib.metadata import version

    results["env"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                      "numba-cuda": version("numba-cuda"), "numpy": np.__version__,
                      "gpus": [torch.cuda.get_device_name(d) for d in (0, 1)]}
    total = time.perf_counter()
    for d in (0, 1):
        torch.ones(1, device=f"cuda:{d}")  # create torch's (primary) contexts first
    results["peer_access"] = enable_peer_access(2)
    start = time.perf_counter()
    launcher(0, 1, 1)  # compiles the executor once (later launchers only load it)
    results["compile_s"] = time.perf_counter() - start
    print(f"env {results['env']}\npeer access {results['peer_access']}; "
          f"compile {results['compile_s']:.1f} s")
    save()
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    sections = [("copy", lambda: section_copy(torch)),
                ("allreduce", lambda: section_allreduce(torch, streams)),
                ("graphs", lambda: section_graphs(torch, streams)),
                ("eager", lambda: section_eager(torch, streams)),
                ("trace", lambda: section_trace(torch, streams)),
                ("timeout", lambda: section_timeout(torch, streams))]
    for name, fn in sections:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - record and go on to the next section
            results[name] = {"ok": False, "exception": traceback.format_exc()}
            print(f"\n[{name}] FAILED\n{results[name]['exception']}")
        results[name]["seconds"] = time.perf_counter() - start
        save()
    results["total_s"] = time.perf_counter() - total
    results["ok"] = all(results[name].get("ok") for name, _ in sections)
    save()
    print(f"\nall ok: {results['ok']}  ({results['total_s']:.0f} s)  -> {out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
