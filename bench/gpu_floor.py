"""The floor of a small all-reduce on 2 GPUs: hand-written one-shot kernels, no interpreter.

    PYTHONPATH=. python3 bench/gpu_floor.py --out DIR      # 2 GPUs, ~1-2 minutes

How fast can a bf16 sum of two ranks' buffers be at 8 KiB .. 1 MiB on these GPUs, if nothing
but the protocol runs? Each kernel below is one launch per rank per call, fixed to 2 ranks,
with no table, no timeout and no error record -- the parts the executor adds -- so the gap
between these times and Purlin's ``auto`` is what the interpreter costs, and the gap to NCCL is
what the protocol can win:

* ``empty``    -- thread 0 of block 0 bumps a counter: the launch floor inside a CUDA graph;
* ``flag``     -- push 16-byte vectors into the peer's scratch, one system-scope release add
  per block on the peer's flag, wait for our own flag, then add (two scratch parities);
* ``ll``       -- Purlin's LL units ({data, tag, data, tag} per 8 bytes, tag = call + 1), each
  thread polls its own units and adds them to its own input in the same pass (no scratch, no
  barrier between receive and reduce);
* ``lamport``  -- the data is the flag: the receive areas hold bf16 -0.0 everywhere; a sender
  writes its input with -0.0 turned into +0.0, the receiver polls each 16-byte vector until no
  element is -0.0, adds, and writes -0.0 back into the area of the call before (three areas
  in turn, so a peer two calls ahead cannot overwrite what is still being cleared). Half the
  link bytes of ``ll``.

Every kernel also runs with programmatic dependent launch (``+pdl``). Grids of 1..32 blocks of
128..512 threads; CUDA-graph replays of 50 calls, median of 20; the result of the last call is
checked against torch's bf16 sum. NCCL, PyTorch's symmetric-memory one-shot and Purlin's
``auto`` are timed in the same run. Prints the best of each kernel per size and writes
``DIR/floor.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"})
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from purlin.kernels.intrinsics import (  # noqa: E402
    bits_to_f32, f32x2_to_bf16x2, griddep_launch_dependents, griddep_wait, load_acquire,
    load_i64, load_u32, load_v4_u32, load_volatile_v4_u32, red_release_add, store_i64,
    store_u32, store_v4_u32, store_volatile_v4_u32)

KiB = 1 << 10
SIZES = (8 * KiB, 64 * KiB, 256 * KiB, 1 << 20)
GRIDS = ((1, 512), (2, 512), (4, 512), (8, 512), (16, 512), (32, 512), (8, 256), (16, 256),
         (32, 256), (16, 128), (32, 128))
NEG_ZERO2 = 0x80008000  # two bf16 -0.0
SIG = "void(int64, int64, int64, int64, int64, int64, int64)"
MAX_SPINS = 1 << 21  # a probe that loses a message gives up (~1 s) instead of hanging


# ------------------------------------------------------------------------------------ helpers
@cuda.jit(device=True, forceinline=True)
def add_bf16x2(a, b):
    lo = bits_to_f32((a & 0xFFFF) << 16) + bits_to_f32((b & 0xFFFF) << 16)
    hi = bits_to_f32(a & 0xFFFF0000) + bits_to_f32(b & 0xFFFF0000)
    return f32x2_to_bf16x2(lo, hi)


@cuda.jit(device=True, forceinline=True)
def no_neg_zero(w):
    """The word with every bf16 -0.0 made +0.0 (so -0.0 can mark 'not yet written')."""
    if (w & 0xFFFF) == 0x8000:
        w = w & 0xFFFF0000
    if (w & 0xFFFF0000) == 0x80000000:
        w = w & 0xFFFF
    return w


@cuda.jit(device=True, forceinline=True)
def has_neg_zero(w):
    return (w & 0xFFFF) == 0x8000 or (w & 0xFFFF0000) == 0x80000000


@cuda.jit(device=True, forceinline=True)
def begin(epochs, pdl):
    """(this block's call number, its global thread index, the grid's thread count)."""
    if pdl:
        griddep_launch_dependents()
        griddep_wait()
    sh = cuda.shared.array(1, np.int64)
    if cuda.threadIdx.x == 0:
        sh[0] = load_i64(epochs + cuda.blockIdx.x * 8)
    cuda.syncthreads()
    return sh[0], cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, \
        cuda.gridDim.x * cuda.blockDim.x


@cuda.jit(device=True, forceinline=True)
def finish(epochs, epoch, errors, lost):
    cuda.syncthreads()
    if lost:
        store_i64(errors, 1)
    if cuda.threadIdx.x == 0:
        store_i64(epochs + cuda.blockIdx.x * 8, epoch + 1)


# ------------------------------------------------------------------------------------ kernels
@cuda.jit(device=True, forceinline=True)
def empty_body(inp, out, mine, peer, nbytes, epochs, errors, pdl):
    if pdl:
        griddep_launch_dependents()
        griddep_wait()
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        store_i64(epochs, load_i64(epochs) + 1)


@cuda.jit(device=True, forceinline=True)
def flag_body(inp, out, mine, peer, nbytes, epochs, errors, pdl):
    # mine / peer: [flags: 64 int64 per block slot][scratch parity 0][scratch parity 1]
    epoch, g, stride = begin(epochs, pdl)
    part = 4096 + (epoch & 1) * nbytes
    nvec = nbytes // 16
    i = g
    while i < nvec:
        store_v4_u32(peer + part + i * 16, load_v4_u32(inp + i * 16))
        i += stride
    cuda.syncthreads()
    lost = False
    if cuda.threadIdx.x == 0:
        red_release_add(peer + cuda.blockIdx.x * 8, 1)
        spins = 0
        while load_acquire(mine + cuda.blockIdx.x * 8) < epoch + 1 and spins < MAX_SPINS:
            spins += 1
        lost = spins == MAX_SPINS
    cuda.syncthreads()
    i = g
    while i < nvec:
        a = load_v4_u32(inp + i * 16)
        b = load_v4_u32(mine + part + i * 16)
        store_v4_u32(out + i * 16, (add_bf16x2(a[0], b[0]), add_bf16x2(a[1], b[1]),
                                    add_bf16x2(a[2], b[2]), add_bf16x2(a[3], b[3])))
        i += stride
    finish(epochs, epoch, errors, lost)


@cuda.jit(device=True, forceinline=True)
def ll_body(inp, out, mine, peer, nbytes, epochs, errors, pdl):
    # mine / peer: two parities of LL units, 2 * nbytes each
    epoch, g, stride = begin(epochs, pdl)
    tag = (epoch & 0x3FFFFFFF) + 1
    part = (epoch & 1) * 2 * nbytes
    nunits = nbytes // 8
    i = g
    while i < nunits:
        store_volatile_v4_u32(peer + part + i * 16,
                              (load_u32(inp + i * 8), tag, load_u32(inp + i * 8 + 4), tag))
        i += stride
    lost = False
    i = g
    while i < nunits:
        v = load_volatile_v4_u32(mine + part + i * 16)
        spins = 0
        while (v[1] != tag or v[3] != tag) and spins < MAX_SPINS:
            v = load_volatile_v4_u32(mine + part + i * 16)
            spins += 1
        lost = lost or spins == MAX_SPINS
        store_u32(out + i * 8, add_bf16x2(load_u32(inp + i * 8), v[0]))
        store_u32(out + i * 8 + 4, add_bf16x2(load_u32(inp + i * 8 + 4), v[2]))
        i += stride
    finish(epochs, epoch, errors, lost)


@cuda.jit(device=True, forceinline=True)
def lamport_body(inp, out, mine, peer, nbytes, epochs, errors, pdl):
    # mine / peer: three areas of nbytes, initially all bf16 -0.0
    epoch, g, stride = begin(epochs, pdl)
    cur = (epoch % 3) * nbytes
    before = ((epoch + 2) % 3) * nbytes
    nvec = nbytes // 16
    i = g
    while i < nvec:
        w = load_v4_u32(inp + i * 16)
        store_volatile_v4_u32(peer + cur + i * 16, (no_neg_zero(w[0]), no_neg_zero(w[1]),
                                                    no_neg_zero(w[2]), no_neg_zero(w[3])))
        i += stride
    lost = False
    i = g
    while i < nvec:
        v = load_volatile_v4_u32(mine + cur + i * 16)
        spins = 0
        while (has_neg_zero(v[0]) or has_neg_zero(v[1]) or has_neg_zero(v[2])
               or has_neg_zero(v[3])) and spins < MAX_SPINS:
            v = load_volatile_v4_u32(mine + cur + i * 16)
            spins += 1
        lost = lost or spins == MAX_SPINS
        a = load_v4_u32(inp + i * 16)
        store_v4_u32(out + i * 16, (add_bf16x2(a[0], v[0]), add_bf16x2(a[1], v[1]),
                                    add_bf16x2(a[2], v[2]), add_bf16x2(a[3], v[3])))
        store_v4_u32(mine + before + i * 16, (NEG_ZERO2, NEG_ZERO2, NEG_ZERO2, NEG_ZERO2))
        i += stride
    finish(epochs, epoch, errors, lost)


def _kernels():
    """{(name, pdl): kernel}, each ``(inp, out, mine, peer, nbytes, epochs, errors)``."""
    bodies = {"empty": empty_body, "flag": flag_body, "ll": ll_body, "lamport": lamport_body}
    out = {}
    for name, body in bodies.items():
        for pdl in (False, True):
            def make(body=body, pdl=pdl):
                def kernel(inp, out, mine, peer, nbytes, epochs, errors):
                    body(inp, out, mine, peer, nbytes, epochs, errors, pdl)
                return cuda.jit(kernel)
            out[(name, pdl)] = make()
    return out


def area_bytes(name: str, nbytes: int) -> int:
    return {"empty": 64, "flag": 4096 + 2 * nbytes, "ll": 4 * nbytes,
            "lamport": 3 * nbytes}[name]


class RawLaunch:
    """One kernel on one device, seven int64 arguments, launched with ``cuLaunchKernel(Ex)``
    (capturable; PDL through the programmatic-stream-serialization attribute)."""

    def __init__(self, kernel, device: int, grid: int, threads: int, args, pdl: bool):
        from cuda.bindings import driver

        with cuda.gpus[device]:
            compiled = kernel.compile(SIG)
            compiled.bind()
            cufunc = compiled._codelibrary.get_cufunc()
        self.driver, self.grid, self.threads = driver, grid, threads
        self.function = driver.CUfunction(int(cufunc.handle))
        self.values = (ctypes.c_int64 * 7)(*args)
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * 7)(*(base + 8 * i for i in range(7)))
        self.config = None
        if pdl:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
            attr = driver.CUlaunchAttribute()
            attr.id = (driver.CUlaunchAttributeID
                       .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs, cfg.numAttrs = [attr], 1
            self.config = cfg

    def __call__(self, stream: int) -> None:
        handle = self.driver.CUstream(stream)
        if self.config is not None:
            self.config.hStream = handle
            (err,) = self.driver.cuLaunchKernelEx(self.config, self.function,
                                                  ctypes.addressof(self.params), 0)
        else:
            (err,) = self.driver.cuLaunchKernel(self.function, self.grid, 1, 1, self.threads,
                                                1, 1, 0, handle, ctypes.addressof(self.params), 0)
        if err:
            raise RuntimeError(f"launch failed: {err!r}")


def time_pair(torch, launches, ops: int = 50, repeats: int = 20) -> float:
    """Median microseconds per call of the two devices' launches replayed from CUDA graphs
    (the slower device of each replay)."""
    graphs = []
    for d, launch in enumerate(launches):
        with torch.cuda.device(d):
            torch.cuda.synchronize()
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device=d)
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(ops):
                    launch(stream.cuda_stream)
            graphs.append(graph)
    for d, g in enumerate(graphs):
        with torch.cuda.device(d):
            g.replay()
    times = []
    for _ in range(repeats):
        events = []
        for d in range(2):
            with torch.cuda.device(d):
                torch.cuda.synchronize()
        for d in range(2):
            with torch.cuda.device(d):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                events.append((s, e))
        for d, g in enumerate(graphs):
            with torch.cuda.device(d):
                g.replay()
        for d, (s, e) in enumerate(events):
            with torch.cuda.device(d):
                e.record()
        for _, e in events:
            e.synchronize()
        times.append(max(s.elapsed_time(e) for s, e in events) * 1e3 / ops)
    return float(np.median(times))


def run_kernel(torch, kernels, name, pdl, nbytes, blocks, threads):
    """Time one configuration; returns (µs per call, wrong elements on either rank)."""
    count = nbytes // 2
    gen = torch.Generator().manual_seed(nbytes + blocks)
    host = [torch.randn(count, generator=gen).to(torch.bfloat16) for _ in range(2)]
    inp = [host[d].to(f"cuda:{d}") for d in range(2)]
    out = [torch.zeros(count, dtype=torch.bfloat16, device=f"cuda:{d}") for d in range(2)]
    areas = [torch.zeros(area_bytes(name, nbytes), dtype=torch.uint8, device=f"cuda:{d}")
             for d in range(2)]
    if name == "lamport":
        for a in areas:
            a.view(torch.int16).fill_(-32768)  # bf16 -0.0
    epochs = [torch.zeros(64, dtype=torch.int64, device=f"cuda:{d}") for d in range(2)]
    errors = [torch.zeros(1, dtype=torch.int64, device=f"cuda:{d}") for d in range(2)]
    launches = [RawLaunch(kernels[(name, pdl)], d, blocks, threads,
                          (inp[d].data_ptr(), out[d].data_ptr(), areas[d].data_ptr(),
                           areas[1 - d].data_ptr(), nbytes, epochs[d].data_ptr(),
                           errors[d].data_ptr()), pdl)
                for d in range(2)]
    us = time_pair(torch, launches)
    for d in range(2):
        torch.cuda.synchronize(d)
    if name == "empty":
        return us, 0
    want = (host[0].float() + host[1].float()).to(torch.bfloat16)
    wrong = sum(int((out[d].cpu() != want).sum()) for d in range(2))
    wrong += sum(int(errors[d].item()) for d in range(2))
    return us, wrong


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from purlin.atom.sm import enable_peer_access
    from purlin.kernels.compat import ensure_numpy_compat
    from purlin.bench.providers import time_graph
    from purlin.bench.torch_dist import run_baselines
    from purlin.runtime import Cluster
    from purlin.spec import collectives

    ensure_numpy_compat()
    enable_peer_access([0, 1])
    kernels = _kernels()
    rows = []
    for name in ("empty", "flag", "ll", "lamport"):
        for pdl in (False, True):
            for nbytes in SIZES if name != "empty" else (8 * KiB,):
                for blocks, threads in GRIDS:
                    if name == "ll" and nbytes // 8 < blocks * threads // 4:
                        continue  # most threads idle: not a candidate
                    try:
                        us, wrong = run_kernel(torch, kernels, name, pdl, nbytes, blocks,
                                               threads)
                        rows.append({"kernel": name, "pdl": pdl, "nbytes": nbytes,
                                     "blocks": blocks, "threads": threads, "us": us,
                                     "wrong": wrong})
                    except Exception as e:  # noqa: BLE001 - keep the other points
                        rows.append({"kernel": name, "pdl": pdl, "nbytes": nbytes,
                                     "blocks": blocks, "threads": threads, "error": repr(e)})
                        print("FAILED", rows[-1], flush=True)
            print(f"{name} pdl={pdl}: done", flush=True)

    cluster = Cluster.local(2)
    coll = collectives.all_reduce(2)
    purlin = {}
    for nbytes in SIZES:
        bound = cluster.bind(coll, "auto", nbytes=nbytes, dtype="bfloat16")
        purlin[nbytes] = float(np.median(time_graph(torch, bound, 50, 20)))
        del bound
    base = {}
    if not args.no_baselines:
        points = [(p, "all-reduce", s, "bfloat16", "sum", "graph")
                  for p in ("nccl", "symm-one-shot") for s in SIZES]
        for r in run_baselines(points, world=2):
            base[(r.provider, r.nbytes)] = r.time_us

    lines = [f"{'size':>8} {'nccl':>7} {'symm1':>7} {'purlin':>7} | best per kernel "
             "(µs, grid, pdl)"]
    for nbytes in SIZES:
        best = []
        for name in ("flag", "ll", "lamport"):
            ok = [r for r in rows if r["kernel"] == name and r["nbytes"] == nbytes
                  and "us" in r and r["wrong"] == 0]
            if ok:
                b = min(ok, key=lambda r: r["us"])
                best.append(f"{name} {b['us']:.2f} ({b['blocks']}x{b['threads']}"
                            f"{' pdl' if b['pdl'] else ''})")
        lines.append(f"{nbytes:>8} {base.get(('nccl', nbytes), float('nan')):7.2f} "
                     f"{base.get(('symm-one-shot', nbytes), float('nan')):7.2f} "
                     f"{purlin[nbytes]:7.2f} | " + "; ".join(best))
    empties = [r for r in rows if r["kernel"] == "empty" and "us" in r]
    lines.append("empty kernel per call: " + ", ".join(
        f"{r['blocks']}x{r['threads']}{' pdl' if r['pdl'] else ''} {r['us']:.2f}"
        for r in empties))
    bad = [r for r in rows if r.get("wrong") or "error" in r]
    lines.append(f"configurations: {len(rows)}, wrong or failed: {len(bad)}")
    print("\n".join(lines))
    info = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "gpu": torch.cuda.get_device_name(0), "commit": os.environ.get("PURLIN_COMMIT")}
    (out / "floor.json").write_text(json.dumps(
        {"info": info, "rows": rows, "purlin_auto_us": purlin,
         "baselines_us": {f"{p}/{n}": t for (p, n), t in base.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
