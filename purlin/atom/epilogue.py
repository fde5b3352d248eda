"""User-written fused epilogues: a Numba CUDA device function run inside the all-reduce's
kernel on the reduced values before they are written -- or, where that one-shot kernel does not
run (larger sizes, other strategies), by the epilogue kernel right after the all-reduce
(:mod:`purlin.kernels.epilogue` builds both; ARCHITECTURE.md, "Add a fused epilogue").

Two forms. Per element, ``fn(v, *e) -> y``: ``v`` the reduced value, ``e`` the extra tensors'
elements at the same place (float32 each). Per row, with ``stat``: ``stat(v, *e)`` per element
returns a float (summed over the row) or a pair (summed, maximised); ``finish(total, peak) ->
(p, q)`` runs once per row; then ``fn(v, p, q, *e) -> y``. ``residual=`` first does
``residual += v`` (rounded to the element type) and hands the new residual on as ``v``.
``prologue(x, *e) -> x'`` runs before the all-reduce on each rank's input, rewritten in place
(the staging copy, or the caller's tensor where the kernel reads it directly). With
``wire="float8_e4m3fn"`` (or ``"float8_e5m2"``) the prologue's float32 result is sent as FP8
instead, the input left as it is, and ``v`` is every rank's decoded FP8 summed in rank order in
float32 (per element only; ``fn`` typically multiplies the scale back).

>>> import math
>>> def gelu(v, bias):
...     x = v + bias
...     return 0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))
>>> import torch
>>> e = Epilogue(gelu, extras=(torch.zeros(4),))
>>> y = torch.tensor([[1.0, -1.0, 0.0, 2.0]])
>>> _ = e.reference(y)
>>> [round(v, 4) for v in y[0].tolist()]
[0.8413, -0.1587, 0.0, 1.9545]
>>> Epilogue(lambda v: v, extras=(torch.zeros(4),)).check(y)
Traceback (most recent call last):
...
purlin.errors.SpecError: epilogue '<lambda>': fn must take (v, e0) -- the value, then one per extra tensor; it takes (v)
"""

from __future__ import annotations

import inspect

import numpy as np

from purlin.errors import SpecError
from purlin.spec.dtypes import FP8

__all__ = ["Epilogue", "rms_norm", "wire_sums"]

_FP8 = "float8_e4m3fn"


class Epilogue:
    """A user epilogue for an all-reduce (the module says what each function receives).

    ``extras``: tensors of the all-reduce's dtype, of its element count (read element by
    element) or of ``hidden`` elements (the tensor's last dimension: read by column, as a
    bias or a weight). ``out``: where ``y`` goes (default: the all-reduce's tensor; a
    ``torch.float8_e4m3fn`` tensor of its element count: quantised on the way, 448 and beyond
    saturated to 448; the tensor then holds nothing defined). ``row_out``: a float32 tensor of one element per row that takes each
    row's ``q`` (a per-token scale). ``hidden``: the row length, where the tensor is flat.
    ``wire``: an FP8 dtype the prologue's values travel in (e4m3fn saturating at 448), half
    the bytes of bfloat16, decoded and summed in float32 before ``fn`` (a sum, per element).
    """

    def __init__(self, fn, extras=(), *, residual=None, stat=None, finish=None, out=None,
                 row_out=None, hidden: int | None = None, prologue=None,
                 name: str | None = None, wire=None):
        self.hidden, self.prologue = hidden, prologue
        self.builtin = None  # (weight, eps) of rms_norm: the built-in kernel runs it too
        self.fn, self.extras, self.residual = fn, tuple(extras), residual
        self.stat, self.finish, self.out, self.row_out = stat, finish, out, row_out
        self.name = name or getattr(getattr(fn, "py_func", fn), "__name__", "epilogue")
        if finish is not None and stat is None:
            raise SpecError(f"epilogue {self.name!r}: finish needs stat (the per-row form)")
        if row_out is not None and stat is None:
            raise SpecError(f"epilogue {self.name!r}: row_out needs stat (the per-row form)")
        self.wire = None if wire is None else str(wire).removeprefix("torch.")
        if self.wire is not None:
            _check_wire(self)

    def tensors(self) -> list:
        """Every tensor the kernel reads or writes besides the all-reduce's."""
        return [t for t in (self.residual, self.out, self.row_out, *self.extras)
                if t is not None]

    def key(self) -> tuple:
        """What a program ending with this epilogue depends on: its functions and its
        tensors' addresses (two epilogues with the same key share a program)."""
        ptr = (lambda t: 0 if t is None else t.data_ptr())
        return ("epilogue", id(self.fn), id(self.stat), id(self.finish), id(self.prologue),
                self.hidden, self.wire,
                ptr(self.residual), ptr(self.out), ptr(self.row_out),
                *(t.data_ptr() for t in self.extras), *(t.numel() for t in self.extras))

    def record(self, target: int, sums: int, hidden: int):
        """The program's :class:`purlin.atom.fused.Epilogue` for this epilogue over
        ``target`` (the all-reduce's output address) with row sums at ``sums``."""
        from purlin.atom.fused import Epilogue as Record

        ptr = (lambda t: 0 if t is None else t.data_ptr())
        weight, eps = self.builtin or (None, 0.0)
        return Record(target, ptr(self.residual), ptr(weight), sums, hidden, float(eps),
                      (ptr(self.out), ptr(self.row_out), *(t.data_ptr() for t in self.extras)))

    def __repr__(self) -> str:
        form = "row" if self.stat is not None else "element"
        wire = f", {self.wire} on the wire" if self.wire else ""
        return f"Epilogue({self.name!r}, per {form}, {len(self.extras)} extra(s){wire})"

    # ---- checks, before anything compiles into a kernel
    def check(self, tensor, hidden: int | None = None) -> dict:
        """Check this epilogue against the all-reduce's ``tensor`` (rows of ``hidden``
        elements, default its last dimension): shapes, dtypes and every device function's
        signature (compiled for float32 arguments up front). Returns what the kernel needs
        (``hidden``, ``per_column``, ``stats``); raises SpecError naming the epilogue, the
        function, the signature expected and the dtype."""
        import torch

        hidden = int(hidden or self.hidden or (tensor.shape[-1] if tensor.dim() else 1))
        count = tensor.numel()
        if hidden < 1 or count % hidden:
            raise SpecError(f"epilogue {self.name!r}: rows of {hidden} elements do not divide "
                            f"the tensor's {count}")
        if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise SpecError(f"epilogue {self.name!r}: the all-reduce's dtype is {tensor.dtype}; "
                            "an epilogue follows a bfloat16, float16 or float32 sum")
        if self.wire is not None and hidden % WIRE_UNIT:
            raise SpecError(f"epilogue {self.name!r}: on an FP8 wire a row is whole LL units of "
                            f"{WIRE_UNIT} elements; rows of {hidden} are not (pad the rows)")
        per_column = []
        for k, e in enumerate(self.extras):
            if e.dtype != tensor.dtype:
                raise SpecError(f"epilogue {self.name!r}: extra {k} is {e.dtype}, the tensor "
                                f"{tensor.dtype}; give extras of the tensor's dtype "
                                f"(e.to({tensor.dtype}))")
            if e.numel() not in (count, hidden) or not e.is_contiguous():
                raise SpecError(f"epilogue {self.name!r}: extra {k} has {e.numel()} elements; "
                                f"it needs the tensor's {count} or a row's {hidden}, contiguous")
            per_column.append(e.numel() == hidden and hidden != count)
        if self.residual is not None and (self.residual.dtype != tensor.dtype
                                          or self.residual.numel() != count):
            raise SpecError(f"epilogue {self.name!r}: the residual must hold the tensor's "
                            f"{count} {tensor.dtype} elements; got {self.residual.numel()} "
                            f"{self.residual.dtype}")
        if self.out is not None and (self.out.numel() != count or self.out.dtype not in (
                tensor.dtype, getattr(torch, _FP8))):
            raise SpecError(f"epilogue {self.name!r}: out must hold {count} elements of "
                            f"{tensor.dtype} or {_FP8}; got {self.out.numel()} {self.out.dtype}")
        if self.row_out is not None and (self.row_out.dtype != torch.float32
                                         or self.row_out.numel() != count // hidden):
            raise SpecError(f"epilogue {self.name!r}: row_out must hold one float32 per row "
                            f"({count // hidden}); got {self.row_out.numel()} "
                            f"{self.row_out.dtype}")
        for what, t in (("the residual", self.residual), ("out", self.out),
                        ("row_out", self.row_out), *((f"extra {k}", x)
                                                     for k, x in enumerate(self.extras))):
            if t is None:
                continue
            if not t.is_contiguous():
                raise SpecError(f"epilogue {self.name!r}: {what} is strided; pass "
                                f"a contiguous tensor (.contiguous())")
            if tensor.device.type != "meta" and t.device != tensor.device:
                raise SpecError(f"epilogue {self.name!r}: {what} is on {t.device}, the "
                                f"all-reduce's output on {tensor.device}")
            if t.data_ptr() % 4:  # the kernel reads and writes 4-byte words of it
                raise SpecError(f"epilogue {self.name!r}: {what} starts at an address that "
                                f"is not 4-byte aligned ({t.data_ptr():#x}); pass a tensor "
                                "of its own (.clone())")
        names = [f"e{k}" for k in range(len(self.extras))]
        stats = 1
        if self.stat is not None:
            stats = _check_function(self.name, "stat", self.stat, ["v", *names], (1, 2))
            if self.finish is not None:
                _check_function(self.name, "finish", self.finish, ["total", "peak"], (2,))
            _check_function(self.name, "fn", self.fn, ["v", "p", "q", *names], (1,))
        else:
            _check_function(self.name, "fn", self.fn, ["v", *names], (1,))
        if self.prologue is not None:
            _check_function(self.name, "prologue", self.prologue, ["x", *names], (1,))
        return {"hidden": hidden, "per_column": tuple(per_column), "stats": stats}

    def form(self, tensor, hidden: int | None = None):
        """The :class:`purlin.kernels.epilogue.Form` of this epilogue after ``tensor``'s
        all-reduce (checked first)."""
        from purlin.kernels import isa
        from purlin.kernels.epilogue import Form

        info = self.check(tensor, hidden)
        dt = isa.DTYPE_CODES[str(tensor.dtype).removeprefix("torch.")]
        return Form(_device(self.fn), dt, info["per_column"], self.residual is not None,
                    _device(self.stat) if self.stat is not None else None, info["stats"],
                    _device(self.finish) if self.finish is not None else None,
                    self.out is not None and str(self.out.dtype).endswith(_FP8),
                    self.row_out is not None,
                    _device(self.prologue) if self.prologue is not None else None,
                    wire=isa.DTYPE_CODES[self.wire] if self.wire else 0)

    # ---- the same in PyTorch (the cpu datapath, and the reference the tests compare with)
    def reference_prologue(self, tensor, hidden: int | None = None):
        """The prologue on a rank's input ``tensor`` on the host, in place (rounded to its
        dtype), as the kernel does before sending it; returns ``tensor``. With a wire: the
        FP8 values it sends, decoded (:meth:`reference_wire`; exact in the element type),
        where an all-reduce of the element type stands in for the kernel."""
        import torch

        if self.prologue is None:
            return tensor
        if self.wire is not None:
            y = self.reference_wire(tensor, hidden)
        else:
            y = torch.from_numpy(self._host_prologue(tensor, hidden))
        tensor.copy_(y.to(tensor.device).to(tensor.dtype).reshape(tensor.shape))
        return tensor

    def _host_prologue(self, tensor, hidden: int | None) -> np.ndarray:
        """The prologue on ``tensor`` on the host: float32 rows."""
        info = self.check(tensor, hidden)
        hidden = info["hidden"]
        rows = tensor.numel() // hidden
        x = tensor.detach().reshape(rows, hidden).float()
        e = [t.detach().reshape(hidden if col else (rows, hidden)).float().expand(rows, hidden)
             for t, col in zip(self.extras, info["per_column"])]
        host = [np.ascontiguousarray(t.cpu().numpy()) for t in (x, *e)]
        return np.asarray(_vectorize(self.prologue, 1)(*host), np.float32)

    def reference_wire(self, tensor, hidden: int | None = None):
        """What a rank with input ``tensor`` sends on the FP8 wire, as its peers decode it:
        the prologue in float32, encoded once to ``wire`` (e4m3fn saturating at 448, e5m2
        to infinity, as :func:`purlin.spec.dtypes.fp8_encode`) and decoded; a flat float32
        tensor on the host (``tensor`` is left as it is).

        >>> import torch
        >>> e = Epilogue(lambda v: v, prologue=lambda x: x * 100.0, wire="float8_e4m3fn")
        >>> e.reference_wire(torch.tensor([[0.011, 5.0, -1.0, 0, 0, 0, 0, 0]]))[:3].tolist()
        [1.125, 448.0, -96.0]
        """
        import torch

        from purlin.spec.dtypes import fp8_decode, fp8_encode

        y = self._host_prologue(tensor, hidden).reshape(-1)
        return torch.from_numpy(fp8_decode(fp8_encode(y, self.wire), self.wire))

    def reference(self, tensor, hidden: int | None = None, sums=None):
        """Apply the epilogue to ``tensor`` (the all-reduce's result) on the host, as the
        kernel does: float32 inside, the residual rounded to the element type, one rounding
        of ``y``. ``sums``: float32 values taken as the result instead (an FP8 wire's sum,
        :func:`wire_sums`). Writes the outputs in place; returns ``tensor``."""
        import torch

        info = self.check(tensor, hidden)
        hidden = info["hidden"]
        rows = tensor.numel() // hidden
        v = tensor.detach().reshape(rows, hidden).float()
        if sums is not None:
            v = torch.as_tensor(sums, dtype=torch.float32).to(tensor.device).reshape(rows, hidden)
        if self.residual is not None:
            new = (v + self.residual.detach().reshape(rows, hidden).float()).to(tensor.dtype)
            self.residual.copy_(new.reshape(self.residual.shape))
            v = new.float()
        e = [x.detach().reshape(hidden if col else (rows, hidden)).float().expand(rows, hidden)
             for x, col in zip(self.extras, info["per_column"])]
        host = [np.ascontiguousarray(t.cpu().numpy()) for t in (v, *e)]
        if self.stat is not None:
            got = _vectorize(self.stat, info["stats"])(*host)
            if info["stats"] == 1:
                total, peak = got.sum(axis=1, dtype=np.float32), np.full(rows, -np.inf,
                                                                         np.float32)
            else:
                total, peak = got[0].sum(axis=1, dtype=np.float32), got[1].max(axis=1)
            if self.finish is not None:
                p, q = _vectorize(self.finish, 2)(total, peak)
            else:
                p, q = total, peak
            y = _vectorize(self.fn, 1)(host[0], p[:, None], q[:, None], *host[1:])
            if self.row_out is not None:
                self.row_out.copy_(torch.from_numpy(np.asarray(q, np.float32)).reshape(
                    self.row_out.shape))
        else:
            y = _vectorize(self.fn, 1)(*host)
        y = torch.from_numpy(np.asarray(y, dtype=np.float32)).to(tensor.device)
        out = self.out if self.out is not None else tensor
        if str(out.dtype).endswith(_FP8):
            y = y.clamp(-448.0, 448.0)  # the kernel saturates
        out.copy_(y.to(out.dtype).reshape(out.shape))
        return tensor


def per_rank(epilogue, schedule) -> list:
    """``epilogue`` (one per rank, or one for every rank) as a list, checked against
    ``schedule``: an all-reduce."""
    from purlin.errors import CapabilityError

    n = schedule.nranks
    if schedule.collective.name != "all-reduce":
        raise CapabilityError(f"a user epilogue follows an all-reduce, not "
                              f"{schedule.collective.name}")
    epis = list(epilogue) if isinstance(epilogue, (list, tuple)) else [epilogue] * n
    if len(epis) != n or not all(isinstance(e, Epilogue) for e in epis):
        raise SpecError(f"epilogue: one purlin.Epilogue per rank ({n}), or one for all; got "
                        f"{epilogue!r}")
    import torch

    for r, e in enumerate(epis):  # at bind time, on a stand-in for the rank's output
        dtype = getattr(torch, schedule.dtype, None)
        if dtype is not None:
            e.check(torch.empty(schedule.sizing.output_count(r), dtype=dtype, device="meta"))
    _check_wires(epis, schedule)
    return epis


def run_on_outputs(epilogues, outputs, sums=None) -> None:
    """Each rank's epilogue on its output (torch tensors, or numpy arrays of float32 /
    float16), by the host reference; ``sums``: :func:`wire_sums`'s, taken as the result."""
    import torch

    for e, o in zip(epilogues, outputs):
        t = o if isinstance(o, torch.Tensor) else torch.from_numpy(np.asarray(o))
        e.reference(t.reshape(-1), sums=sums)


def prologues_on_inputs(epilogues, inputs) -> list:
    """Each rank's input (flat numpy arrays) after its epilogue's prologue, as copies."""
    import torch

    out = []
    for e, x in zip(epilogues, inputs):
        if e.prologue is not None and e.wire is None and np.size(x):
            x = np.array(x, copy=True)
            e.reference_prologue(torch.from_numpy(x).reshape(-1))
        out.append(x)
    return out


def wire_sums(epilogues, inputs):
    """The all-reduce's result where the epilogues send FP8 (inputs: flat numpy arrays or
    torch tensors): every rank's :meth:`Epilogue.reference_wire` added in rank order in
    float32, as each rank's kernel adds them (a flat float32 tensor); None where they send
    the element type."""
    import torch

    if epilogues[0].wire is None:
        return None
    total = None
    for e, x in zip(epilogues, inputs):
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
        q = e.reference_wire(t.reshape(-1))
        total = q if total is None else total + q
    return total


WIRE_UNIT = 8  # elements of an LL unit on an FP8 wire


def _check_wire(e: Epilogue) -> None:
    """Refuse what an FP8 wire cannot do (the epilogue named)."""
    what = f"epilogue {e.name!r}: wire={e.wire!r}"
    if e.wire not in FP8:
        raise SpecError(f"{what} is not an FP8 dtype; the wire takes {' or '.join(FP8)}")
    if e.prologue is None:
        raise SpecError(f"{what} needs a prologue, prologue(x, *e) -> the value to encode "
                        "(e.g. x / scale, with fn multiplying the scale back)")
    if e.stat is not None:
        raise SpecError(f"{what} runs the per-element form; the per-row form (stat) sends the "
                        "element type (leave wire out)")


def _check_wires(epis: list, schedule) -> None:
    """Every rank's epilogue sends the same wire (peers decode each other's units), and one
    with a wire follows a sum."""
    wires = [e.wire for e in epis]
    if len(set(wires)) > 1:
        r = next(r for r, w in enumerate(wires) if w != wires[0])
        sends = [w or "the element type" for w in (wires[r], wires[0])]
        raise SpecError(f"epilogue {epis[r].name!r}: rank {r} sends {sends[0]} and rank 0 "
                        f"{sends[1]}; give every rank the same wire (the ranks decode each "
                        "other's units)")
    op = schedule.collective.op.reduce_op
    if wires[0] is not None and op != "sum":
        raise SpecError(f"epilogue {epis[0].name!r}: an FP8 wire follows a sum all-reduce, not "
                        f"{op}; use op='sum' (and scale in fn)")


def rms_norm(residual, weight, eps: float = 1e-6) -> Epilogue:
    """The built-in add + RMSNorm as a user epilogue: ``residual += x``, then ``x =
    rms_norm(residual) * weight`` (what ``Communicator.all_reduce_add_rms_norm`` does).

    >>> import torch
    >>> x, r = torch.tensor([[1., 2.]]), torch.tensor([[2., 2.]])
    >>> rms_norm(r, torch.ones(2), 0.0).reference(x), r
    (tensor([[0.8485, 1.1314]]), tensor([[3., 4.]]))
    """
    from purlin.kernels.epilogue import rms_norm_functions

    stat, finish, fn = rms_norm_functions(weight.numel(), float(eps))
    e = Epilogue(fn, extras=(weight,), residual=residual, stat=stat, finish=finish,
                 hidden=weight.numel(), name="add_rms_norm")
    e.builtin = (weight, float(eps))
    return e


_JITTED: dict = {}


def _device(fn):
    """``fn`` as a Numba CUDA device function (a plain Python function is compiled as one,
    once)."""
    from numba import cuda

    if _is_device(fn):
        return fn
    if id(fn) not in _JITTED:
        _JITTED[id(fn)] = (cuda.jit(device=True)(fn), fn)
    return _JITTED[id(fn)][0]


def _is_device(fn) -> bool:
    return hasattr(fn, "py_func") and (getattr(fn, "_device", False)
                                       or getattr(getattr(fn, "targetoptions", {}), "get",
                                                  lambda k: False)("device"))


def _py(fn):
    return getattr(fn, "py_func", fn)


def _check_function(epilogue: str, role: str, fn, params: list[str], results: tuple) -> int:
    """Refuse ``fn`` unless it takes ``params`` and returns ``results`` floats (one of them);
    returns how many it returns. Compiled for float32 arguments (PTX for sm_90) where Numba
    compiles for GPUs, else called once on float32 ones (the simulator)."""
    want = f"{role}({', '.join(params)})"
    what = f"epilogue {epilogue!r}: {role}"
    if not callable(fn):
        raise SpecError(f"{what} must be a Numba CUDA device function (cuda.jit(device=True)) "
                        f"or a Python function; got {type(fn).__name__}")
    if hasattr(fn, "py_func") and not _is_device(fn):
        raise SpecError(f"{what} is a CUDA kernel, not a device function: decorate it with "
                        "@cuda.jit(device=True)")
    try:
        sig = inspect.signature(_py(fn))
        takes = [p.name for p in sig.parameters.values()]
        varargs = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    except (TypeError, ValueError):
        takes, varargs = None, False
    if takes is not None and not varargs and len(takes) != len(params):
        extra = " -- the value, then one per extra tensor" if role == "fn" and params[1:2] != [
            "p"] else ""
        raise SpecError(f"{what} must take ({', '.join(params)}){extra}; it takes "
                        f"({', '.join(takes)})")
    returns = _returns(fn, len(params), what, want)
    if returns not in results:
        raise SpecError(f"{what} must return {' or '.join(_plural(n) for n in results)} "
                        f"(as {want}); it returns {_plural(returns)}")
    return returns


def _plural(n: int) -> str:
    return "one float" if n == 1 else f"a tuple of {n} floats" if n > 0 else "no float"


def _returns(fn, nargs: int, what: str, want: str) -> int:
    """How many floats ``fn`` returns for ``nargs`` float32 arguments (0: something else)."""
    from purlin.kernels.intrinsics import SIMULATOR

    if SIMULATOR:
        try:
            got = _py(fn)(*[np.float32(0.5)] * nargs)
        except Exception as exc:  # the user's code: say what it raised, where it was called
            raise SpecError(f"{what} failed when called as {want} on float32 values: "
                            f"{type(exc).__name__}: {exc}") from None
        items = got if isinstance(got, tuple) else (got,)
        ok = all(isinstance(x, (float, int, np.floating, np.integer)) for x in items)
        return len(items) if ok else 0
    from numba import cuda, types

    try:
        _, resty = cuda.compile_ptx(_py(fn), (types.float32,) * nargs, device=True, cc=(9, 0))
    except Exception as exc:  # Numba's typing error: its first line says what failed
        first = str(exc).strip().splitlines()
        raise SpecError(f"{what} does not compile for float32 arguments as {want}: "
                        f"{first[0] if first else type(exc).__name__}") from None
    if isinstance(resty, types.BaseTuple):
        ok = all(isinstance(t, (types.Float, types.Integer)) for t in resty.types)
        return len(resty.types) if ok else 0
    return 1 if isinstance(resty, (types.Float, types.Integer, types.Boolean)) else 0


def _vectorize(fn, nout: int):
    """``fn`` (its Python function) over numpy arrays, float32 in and out."""
    return np.vectorize(_py(fn), otypes=[np.float32] * nout)

