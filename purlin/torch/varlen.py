"""The variable-length all-to-all of process mode: pack this rank's rows into the padded
all-to-all's slots, run it (``Communicator._run_sized``), unpack what arrived.

Tensors on the host go through ``VarLen.pack``/``unpack`` on numpy views of them; tensors on
a GPU through the kernels of ``purlin.kernels.varlen`` on the current stream (no host sync).
ARCHITECTURE.md, "Variable-length collectives".
"""

from __future__ import annotations

import numpy as np
import torch

from purlin.errors import CallMismatchError, CountError
from purlin.kernels.isa import VL_HEADER
from purlin.spec.collective import _fmt
from purlin.spec.varlen import VarLen

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of host tensor ``t`` (FP8 and bfloat16 as integers of their size)."""
    return t.view(_INT[t.element_size()]).numpy()


class Slots:
    """This rank's slot buffers, tables and error record for one (capacity, row, dtype)."""

    def __init__(self, varlen: VarLen, rank: int, dtype: torch.dtype, device):
        from purlin.runtime.varlen import kernel_view, slot_meta

        self.varlen, self.rank, self.device = varlen, rank, device
        self.kernels = torch.device(device).type == "cuda"  # else numpy on host views
        name = str(dtype).removeprefix("torch.")
        self.sizing = varlen.sized(name)
        self.head, self.slot = varlen.slot(name)
        self.view = kernel_view(varlen, name)
        self.int = getattr(torch, self.view.int_name)
        self.padded_in = torch.zeros(self.sizing.input_count(rank), dtype=dtype, device=device)
        self.padded_out = torch.zeros(self.sizing.output_count(rank), dtype=dtype,
                                      device=device)
        meta_in, meta_out = slot_meta(varlen, rank, name)
        self.headers = meta_out[:, VL_HEADER].copy()
        self.meta_in = torch.from_numpy(meta_in).to(device)
        self.meta_out = torch.from_numpy(meta_out).to(device)
        self.error = torch.zeros(16, dtype=torch.int64, device=device)
        self.out_counts = torch.zeros(varlen.nranks, dtype=torch.int64, device=device)

    def pack(self, flat: torch.Tensor, counts: torch.Tensor) -> None:
        """``flat``: this rank's packed rows; ``counts``: every chunk's rows (this rank's own
        read), int64 on the device."""
        v, r = self.varlen, self.rank
        if not self.kernels:
            sent = self._clamp_host(counts.tolist(), flat.numel() // v.row)
            v.pack(r, _np(flat)[:sum(v.input_counts(r, sent)) * v.row], sent,
                   self.sizing.dtype.name, out=_np(self.padded_in))
            return
        from numba import cuda

        from purlin.kernels import varlen as kv

        arr = cuda.as_cuda_array
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        kw, p = self.view, self.padded_in
        flat = flat[:flat.numel() // v.row * v.row]  # whole rows: whole units
        src = flat.view(self.int) if flat.numel() else p.view(self.int)[:1]
        kv.pack[kv.grid(len(v.collective.input[r]), v.capacity * kw.row), kv.THREADS, stream](
            arr(src), flat.numel() // v.row * kw.row, arr(p.view(self.int)),
            arr(p.view(torch.int64)), arr(counts), arr(self.meta_in), kw.head, kw.row,
            v.capacity, arr(self.error), r)

    def _clamp_host(self, raw, rows_held: int) -> tuple:
        """The counts the pack kernel would send, on the host: each clamped to 0..capacity
        and to the rows the input holds, the first bad one recorded in the error record as
        the kernel records it (so every rank still takes part in the collective)."""
        from purlin.kernels import isa

        v, err = self.varlen, _np(self.error)
        sent, start = [int(c) for c in raw], 0
        for p, name in enumerate(v.collective.input[self.rank]):
            i = v.index(name)
            c = sent[i]
            k = min(max(c, 0), v.capacity)
            code = isa.ERR_COUNT if c != k else isa.ERR_PACKED if start + k > rows_held \
                else isa.ERR_NONE
            if code and err[isa.E_CODE] == isa.ERR_NONE:
                seen, limit = (c, v.capacity) if code == isa.ERR_COUNT else (start + k,
                                                                             rows_held)
                err[[isa.E_CODE, isa.E_RANK, isa.E_STEP, isa.E_FLAG, isa.E_SEEN,
                     isa.E_EXPECTED]] = (code, self.rank, p, i, seen, limit)
            sent[i] = max(0, min(k, rows_held - start))
            start += k
        return tuple(sent)

    def received(self) -> list[int]:
        """Rows each rank sent here, read from the slot headers (synchronizes)."""
        words = self.padded_out.view(torch.int64)[torch.from_numpy(self.headers)
                                                  .to(self.device)]
        return [int(c) for c in words.cpu().tolist()]

    def expect(self, splits) -> None:
        """CallMismatchError unless the senders sent the rows ``splits`` says (host splits)."""
        got = self.received()
        for j, (want, sent) in enumerate(zip(splits, got)):
            if want != sent:
                raise CallMismatchError(
                    f"rank {self.rank} expects {want} rows from rank {j} (output_split_sizes"
                    f"[{j}]) but rank {j} sends {sent} (its input_split_sizes[{self.rank}]); "
                    "every rank's output splits must be the senders' input splits")

    def unpack(self, flat_out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Unpack into ``flat_out`` (room for every row that can arrive); returns the rows per
        sender (int64, on the device)."""
        v, r = self.varlen, self.rank
        if not self.kernels:
            packed, got = v.unpack(r, _np(self.padded_out), self.sizing.dtype.name)
            _np(flat_out)[:packed.size] = packed
            self.out_counts.copy_(torch.tensor(got, dtype=torch.int64))
            return self.out_counts
        from numba import cuda

        from purlin.kernels import varlen as kv

        arr = cuda.as_cuda_array
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        kw, p = self.view, self.padded_out
        kv.unpack[kv.grid(len(v.collective.output[r]), v.capacity * kw.row), kv.THREADS,
                  stream](
            arr(p.view(self.int)), arr(p.view(torch.int64)), arr(flat_out.view(self.int)),
            arr(counts), arr(self.meta_out), kw.head, kw.row, v.capacity,
            arr(self.out_counts))
        return self.out_counts

    def check(self) -> None:
        """Raise the bad count the pack kernel recorded, if any (synchronizes); the record is
        cleared once reported."""
        from purlin.kernels import isa

        rec = self.error.cpu().numpy().copy()  # on the host .cpu() is the tensor itself
        if rec[isa.E_CODE] == isa.ERR_NONE:
            return
        self.error.zero_()
        j = int(rec[isa.E_STEP])
        name = self.varlen.names[int(rec[isa.E_FLAG])]
        where = f"rank {self.rank} chunk {_fmt(name)} (its split for rank {j})"
        by = "on the GPU by the pack kernel" if self.kernels else "by the pack"
        if rec[isa.E_CODE] == isa.ERR_COUNT:
            seen, cap = int(rec[isa.E_SEEN]), int(rec[isa.E_EXPECTED])
            why = "is negative" if seen < 0 else f"is over the capacity of {cap} rows"
            raise CountError(f"{where}: split {seen} {why} (caught {by}; "
                             f"{max(min(seen, cap), 0)} rows were sent); pass a larger "
                             "capacity, or send fewer rows")
        raise CountError(f"{where}: the splits up to this rank need {int(rec[isa.E_SEEN])} rows "
                         f"but the input holds {int(rec[isa.E_EXPECTED])} (caught {by}; the "
                         "rows past the input were not sent)")
