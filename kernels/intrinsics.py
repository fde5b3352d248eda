"""Memory and timer intrinsics on raw int64 device addresses (unified virtual addressing).

Details: the notes after the imports; the design: ARCHITECTURE.md, "GPU facts".
"""

from __future__ import annotations

from types import SimpleNamespace

from purlin.kernels.compat import ensure_numpy_compat

# The helpers:
#
# The executor never sees arrays: tables, flags and buffers are addresses, so one compiled kernel
# serves every collective. Each helper below exists twice, with the same name and meaning:
#
# * compiled: a Numba ``@intrinsic`` emitting a plain LLVM load or store through a global-space
#   pointer (``ld.global.v4.u32`` and friends in the PTX) or a line of inline PTX for what LLVM
#   cannot say (acquire/release at system scope, ``%globaltimer``, bf16/f16 conversions);
# * simulated: a Python function doing the same on host memory with ``ctypes``, used when
#   ``NUMBA_ENABLE_CUDASIM=1`` (there, "device" buffers are numpy arrays, so
#   ``arr.ctypes.data`` is a valid address). Fences are no-ops there; atomics take a lock.
#
# =========================== ====================================================================
# ``load_v4_u32(a)``          16-byte load as a 4-tuple of uint32 (copy, bf16, f16)
# ``load_v4_f32/_i32(a)``     16-byte load as 4 float32 / int32
# ``load_v2_f64(a)``          16-byte load as 2 float64
# ``store_v4_u32(a, t)``      16-byte store of a 4-tuple (``store_v4_f32/_i32``, ``store_v2_f64``)
# ``load_u8/u16/u32(a)``      zero-extended to int64; ``load_i32``, ``load_i64``, ``load_f32/f64``
# ``store_u8/u16/u32(a, v)``  truncating stores; ``store_i64``, ``store_f32``, ``store_f64``
# ``load_volatile_v4_u32(a)`` ``ld.volatile.global.v4.u32`` (LL receivers poll with it)
# ``store_volatile_v4_u32``   ``st.volatile.global.v4.u32`` (LL senders: two (data, tag) pairs;
#                             ``_v2``: one)
# ``load_acquire(a)``         ``ld.acquire.sys.global.u64``
# ``red_release_add(a, v)``   ``red.release.sys.global.add.u64`` (``red_relaxed_add``: ``.relaxed``,
#                             after a ``fence_system()``: a release without a fence of its own)
# ``atomic_add(a, v)``        ``atom.acq_rel.gpu.global.add.u64``, returns the old value
# ``atomic_cas(a, old, new)`` ``atom.acq_rel.gpu.global.cas.b64``, returns the value found
# ``fence_system()``          ``fence.acq_rel.sys``
# ``globaltimer()``           ``mov.u64 %globaltimer`` (nanoseconds)
# ``griddep_wait()``          ``griddepcontrol.wait`` (sm_90: programmatic dependent launch;
#                             ``griddep_launch_dependents()``: ``.launch_dependents``)
# ``bits_to_f32(b)``          reinterpret the low 32 bits as float32 (``f32_to_bits`` back)
# ``f16x2_to_f32(w)``         two float16 in a 32-bit word to (low, high) float32
# ``f32x2_to_f16x2(lo, hi)``  round to nearest even, pack (``f32x2_to_bf16x2`` for bfloat16)
# =========================== ====================================================================

ensure_numpy_compat()

from numba.cuda import config  # noqa: E402  (after the numpy alias, before any compile)

SIMULATOR = bool(config.ENABLE_CUDASIM)


def _compiled() -> SimpleNamespace:
    """The Numba intrinsics (built only when compiling for a real GPU)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
    f32 = ir.FloatType()

    def address(context, builder, ty, value):
        return context.cast(builder, value, ty, types.int64)

    def global_ptr(builder, addr, pointee):
        """A pointer in the global state space, so the PTX says ``ld.global`` / ``st.global``."""
        generic = builder.inttoptr(addr, pointee.as_pointer())
        return builder.addrspacecast(generic, pointee.as_pointer(1))

    def asm(builder, ret, args, text, constraints, values):
        fnty = ir.FunctionType(ret, args)
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), values)

    def vector_load(elem, n):
        tup = types.UniTuple(elem, n)

        @intrinsic
        def load(typingctx, addr):
            if not isinstance(addr, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                vty = ir.VectorType(context.get_value_type(elem), n)
                ptr = global_ptr(builder, address(context, builder, sig.args[0], args[0]), vty)
                vec = builder.load(ptr, align=16)
                items = [builder.extract_element(vec, i32(i)) for i in range(n)]
                return context.make_tuple(builder, tup, items)

            return tup(addr), codegen

        return load

    def vector_store(elem, n):
        @intrinsic
        def store(typingctx, addr, values):
            if not (isinstance(addr, types.Integer) and isinstance(values, types.BaseTuple)
                    and len(values) == n):
                return None

            def codegen(context, builder, sig, args):
                lty = context.get_value_type(elem)
                items = cgutils.unpack_tuple(builder, args[1], n)
                vec = ir.Constant(ir.VectorType(lty, n), ir.Undefined)
                for i, (item, ty) in enumerate(zip(items, sig.args[1].types)):
                    vec = builder.insert_element(vec, context.cast(builder, item, ty, elem), i32(i))
                ptr = global_ptr(builder, address(context, builder, sig.args[0], args[0]),
                                 vec.type)
                builder.store(vec, ptr, align=16)
                return context.get_dummy_value()

            return types.void(addr, values), codegen

        return store

    def scalar_load(bits, result, zero_extend=False):
        @intrinsic
        def load(typingctx, addr):
            if not isinstance(addr, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                lty = ir.IntType(bits) if zero_extend else context.get_value_type(result)
                ptr = global_ptr(builder, address(context, builder, sig.args[0], args[0]), lty)
                value = builder.load(ptr, align=bits // 8)
                return builder.zext(value, i64) if zero_extend else value

            return result(addr), codegen

        return load

    def scalar_store(bits, kind):
        @intrinsic
        def store(typingctx, addr, value):
            if not (isinstance(addr, types.Integer) and isinstance(value, (types.Integer,
                                                                           types.Float))):
                return None

            def codegen(context, builder, sig, args):
                if kind == "int":
                    value = context.cast(builder, args[1], sig.args[1], types.int64)
                    value = builder.trunc(value, ir.IntType(bits)) if bits < 64 else value
                else:
                    value = context.cast(builder, args[1], sig.args[1], kind)
                ptr = global_ptr(builder, address(context, builder, sig.args[0], args[0]),
                                 value.type)
                builder.store(value, ptr, align=bits // 8)
                return context.get_dummy_value()

            return types.void(addr, value), codegen

        return store

    @intrinsic
    def load_acquire(typingctx, addr):
        def codegen(context, builder, sig, args):
            a = address(context, builder, sig.args[0], args[0])
            return asm(builder, i64, [i64], "ld.acquire.sys.global.u64 $0, [$1];",
                       "=l,l,~{memory}", [a])

        return types.int64(addr), codegen

    def red_add(order):
        """``red.<order>.sys.global.add.u64``: an add to a flag that returns nothing."""
        @intrinsic
        def red(typingctx, addr, value):
            def codegen(context, builder, sig, args):
                a = address(context, builder, sig.args[0], args[0])
                v = context.cast(builder, args[1], sig.args[1], types.int64)
                asm(builder, ir.VoidType(), [i64, i64],
                    f"red.{order}.sys.global.add.u64 [$0], $1;", "l,l,~{memory}", [a, v])
                return context.get_dummy_value()

            return types.void(addr, value), codegen

        return red

    red_release_add = red_add("release")
    red_relaxed_add = red_add("relaxed")

    @intrinsic
    def atomic_add(typingctx, addr, value):
        def codegen(context, builder, sig, args):
            a = address(context, builder, sig.args[0], args[0])
            v = context.cast(builder, args[1], sig.args[1], types.int64)
            return asm(builder, i64, [i64, i64], "atom.acq_rel.gpu.global.add.u64 $0, [$1], $2;",
                       "=l,l,l,~{memory}", [a, v])

        return types.int64(addr, value), codegen

    @intrinsic
    def atomic_cas(typingctx, addr, old, new):
        def codegen(context, builder, sig, args):
            a = address(context, builder, sig.args[0], args[0])
            o = context.cast(builder, args[1], sig.args[1], types.int64)
            n = context.cast(builder, args[2], sig.args[2], types.int64)
            return asm(builder, i64, [i64, i64, i64],
                       "atom.acq_rel.gpu.global.cas.b64 $0, [$1], $2, $3;",
                       "=l,l,l,l,~{memory}", [a, o, n])

        return types.int64(addr, old, new), codegen

    def statement(text):
        """An intrinsic of no arguments that emits one PTX statement (a memory clobber)."""
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), [], text, "~{memory}", [])
                return context.get_dummy_value()

            return types.void(), codegen

        return emit

    fence_system = statement("fence.acq_rel.sys;")
    griddep_launch_dependents = statement("griddepcontrol.launch_dependents;")
    griddep_wait = statement("griddepcontrol.wait;")

    @intrinsic
    def globaltimer(typingctx):
        def codegen(context, builder, sig, args):
            return asm(builder, i64, [], "mov.u64 $0, %globaltimer;", "=l", [])

        return types.int64(), codegen

    @intrinsic
    def bits_to_f32(typingctx, bits):
        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.int64)
            return builder.bitcast(builder.trunc(value, i32), f32)

        return types.float32(bits), codegen

    @intrinsic
    def f32_to_bits(typingctx, x):
        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.zext(builder.bitcast(value, i32), i64)

        return types.int64(x), codegen

    @intrinsic
    def f16x2_to_f32(typingctx, word):
        def codegen(context, builder, sig, args):
            w = context.cast(builder, args[0], sig.args[0], types.int64)
            lo = builder.trunc(w, i16)
            hi = builder.trunc(builder.lshr(w, i64(16)), i16)
            items = [asm(builder, f32, [i16], "cvt.f32.f16 $0, $1;", "=f,h", [h])
                     for h in (lo, hi)]
            return context.make_tuple(builder, sig.return_type, items)

        return types.UniTuple(types.float32, 2)(word), codegen

    def pack2(instruction):
        @intrinsic
        def pack(typingctx, lo, hi):
            def codegen(context, builder, sig, args):
                lo_ = context.cast(builder, args[0], sig.args[0], types.float32)
                hi_ = context.cast(builder, args[1], sig.args[1], types.float32)
                # the first source lands in the upper half of the result
                word = asm(builder, i32, [f32, f32], f"{instruction} $0, $1, $2;", "=r,f,f",
                           [hi_, lo_])
                return builder.zext(word, i64)

            return types.int64(lo, hi), codegen

        return pack

    def volatile_load(n: int):
        """``ld.volatile.global.v{n}.u32`` as an n-tuple of uint32: polled by LL receivers
        (never cached in a register)."""
        tup = types.UniTuple(types.uint32, n)
        outs = ", ".join(f"${k}" for k in range(n))
        text = f"ld.volatile.global.v{n}.u32 {{{outs}}}, [${n}];"

        @intrinsic
        def load_volatile(typingctx, addr):
            if not isinstance(addr, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                a = address(context, builder, sig.args[0], args[0])
                ret = ir.LiteralStructType([i32] * n)
                out = asm(builder, ret, [i64], text, "=r," * n + "l,~{memory}", [a])
                items = [builder.extract_value(out, i) for i in range(n)]
                return context.make_tuple(builder, tup, items)

            return tup(addr), codegen

        return load_volatile

    def volatile_store(n: int):
        """``st.volatile.global.v{n}.u32`` of an n-tuple: LL senders' (data, tag) pairs."""
        ins = ", ".join(f"${k + 1}" for k in range(n))
        text = f"st.volatile.global.v{n}.u32 [$0], {{{ins}}};"

        @intrinsic
        def store_volatile(typingctx, addr, values):
            if not (isinstance(addr, types.Integer) and isinstance(values, types.BaseTuple)
                    and len(values) == n):
                return None

            def codegen(context, builder, sig, args):
                a = address(context, builder, sig.args[0], args[0])
                items = [context.cast(builder, item, ty, types.uint32) for item, ty in
                         zip(cgutils.unpack_tuple(builder, args[1], n), sig.args[1].types)]
                asm(builder, ir.VoidType(), [i64] + [i32] * n, text,
                    "l" + ",r" * n + ",~{memory}", [a] + items)
                return context.get_dummy_value()

            return types.void(addr, values), codegen

        return store_volatile

    load_volatile_v4_u32, store_volatile_v4_u32 = volatile_load(4), volatile_store(4)
    store_volatile_v2_u32 = volatile_store(2)

    return SimpleNamespace(
        griddep_launch_dependents=griddep_launch_dependents,
        griddep_wait=griddep_wait,
        load_volatile_v4_u32=load_volatile_v4_u32,
        store_volatile_v4_u32=store_volatile_v4_u32,
        store_volatile_v2_u32=store_volatile_v2_u32,
        load_v4_u32=vector_load(types.uint32, 4),
        load_v4_f32=vector_load(types.float32, 4),
        load_v4_i32=vector_load(types.int32, 4),
        load_v2_f64=vector_load(types.float64, 2),
        store_v4_u32=vector_store(types.uint32, 4),
        store_v4_f32=vector_store(types.float32, 4),
        store_v4_i32=vector_store(types.int32, 4),
        store_v2_f64=vector_store(types.float64, 2),
        load_u8=scalar_load(8, types.int64, zero_extend=True),
        load_u16=scalar_load(16, types.int64, zero_extend=True),
        load_u32=scalar_load(32, types.int64, zero_extend=True),
        load_i32=scalar_load(32, types.int32),
        load_i64=scalar_load(64, types.int64),
        load_f32=scalar_load(32, types.float32),
        load_f64=scalar_load(64, types.float64),
        store_u8=scalar_store(8, "int"),
        store_u16=scalar_store(16, "int"),
        store_u32=scalar_store(32, "int"),
        store_i64=scalar_store(64, "int"),
        store_f32=scalar_store(32, types.float32),
        store_f64=scalar_store(64, types.float64),
        load_acquire=load_acquire,
        red_release_add=red_release_add,
        red_relaxed_add=red_relaxed_add,
        atomic_add=atomic_add,
        atomic_cas=atomic_cas,
        fence_system=fence_system,
        globaltimer=globaltimer,
        bits_to_f32=bits_to_f32,
        f32_to_bits=f32_to_bits,
        f16x2_to_f32=f16x2_to_f32,
        f32x2_to_f16x2=pack2("cvt.rn.f16x2.f32"),
        f32x2_to_bf16x2=pack2("cvt.rn.bf16x2.f32"),
    )


def _simulated() -> SimpleNamespace:
    """Python stand-ins on host addresses, for the CUDA simulator."""
    import ctypes
    import struct
    import threading
    import time

    import numpy as np

    lock = threading.Lock()  # the simulator runs a block's threads as Python threads

    def aligned(addr, size):  # as the GPU: an access of n bytes at a multiple of n
        if int(addr) % size:
            raise ValueError(f"misaligned address: a {size}-byte access at {int(addr):#x} (a "
                             "GPU stops the kernel with 'misaligned address')")

    def load(fmt, scalar=True, convert=None):
        size = struct.calcsize(fmt)

        def fn(addr):
            aligned(addr, size)
            values = struct.unpack(fmt, ctypes.string_at(int(addr), size))
            if convert is not None:
                values = tuple(convert(v) for v in values)
            return values[0] if scalar else values

        return fn

    def store(fmt, bits=None, scalar=True):
        size = struct.calcsize(fmt)
        mask = (1 << bits) - 1 if bits else None

        def fn(addr, values):
            aligned(addr, size)
            values = (values,) if scalar else tuple(values)
            if mask is not None:
                values = tuple(int(v) & mask for v in values)
            else:
                values = tuple(float(v) for v in values)
            ctypes.memmove(int(addr), struct.pack(fmt, *values), size)

        return fn

    def u64_at(addr):
        return ctypes.c_uint64.from_address(int(addr))

    def load_acquire(addr):
        with lock:
            return int(u64_at(addr).value)

    def atomic_add(addr, value):
        with lock:
            cell = u64_at(addr)
            old = int(cell.value)
            cell.value = (old + int(value)) & 0xFFFFFFFFFFFFFFFF
            return old

    def red_release_add(addr, value):
        atomic_add(addr, value)

    red_relaxed_add = red_release_add

    def atomic_cas(addr, old, new):
        with lock:
            cell = u64_at(addr)
            found = int(cell.value)
            if found == int(old) & 0xFFFFFFFFFFFFFFFF:
                cell.value = int(new) & 0xFFFFFFFFFFFFFFFF
            return found

    def bits_to_f32(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def f32_to_bits(x):
        return int(np.float32(x).view(np.uint32))

    def f16x2_to_f32(word):
        word = int(word)
        return tuple(np.float32(np.uint16((word >> s) & 0xFFFF).view(np.float16)) for s in (0, 16))

    def f32x2_to_f16x2(lo, hi):
        lo_, hi_ = (int(np.float16(np.float32(x)).view(np.uint16)) for x in (lo, hi))
        return lo_ | (hi_ << 16)

    def to_bf16(x):
        bits = f32_to_bits(x)
        if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN stays NaN (quiet)
            return (bits >> 16) | 0x40
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16

    def f32x2_to_bf16x2(lo, hi):
        return to_bf16(lo) | (to_bf16(hi) << 16)

    def volatile(fmt):  # one LL unit (or half) at a time, as the GPU's 8-byte halves are
        def load_volatile(addr):
            with lock:
                return load(fmt, scalar=False)(addr)

        def store_volatile(addr, values):
            with lock:
                store(fmt, bits=32, scalar=False)(addr, values)

        return load_volatile, store_volatile

    load_volatile_v4_u32, store_volatile_v4_u32 = volatile("<4I")
    store_volatile_v2_u32 = volatile("<2I")[1]

    return SimpleNamespace(
        griddep_launch_dependents=lambda: None,  # one launch at a time in the simulator
        griddep_wait=lambda: None,
        load_volatile_v4_u32=load_volatile_v4_u32,
        store_volatile_v4_u32=store_volatile_v4_u32,
        store_volatile_v2_u32=store_volatile_v2_u32,
        load_v4_u32=load("<4I", scalar=False),
        load_v4_f32=load("<4f", scalar=False, convert=np.float32),
        load_v4_i32=load("<4i", scalar=False),
        load_v2_f64=load("<2d", scalar=False, convert=np.float64),
        store_v4_u32=store("<4I", bits=32, scalar=False),
        store_v4_f32=store("<4f", scalar=False),
        store_v4_i32=store("<4I", bits=32, scalar=False),
        store_v2_f64=store("<2d", scalar=False),
        load_u8=load("<B"),
        load_u16=load("<H"),
        load_u32=load("<I"),
        load_i32=load("<i"),
        load_i64=load("<q"),
        load_f32=load("<f", convert=np.float32),
        load_f64=load("<d", convert=np.float64),
        store_u8=store("<B", bits=8),
        store_u16=store("<H", bits=16),
        store_u32=store("<I", bits=32),
        store_i64=store("<Q", bits=64),
        store_f32=store("<f"),
        store_f64=store("<d"),
        load_acquire=load_acquire,
        red_release_add=red_release_add,
        red_relaxed_add=red_relaxed_add,
        atomic_add=atomic_add,
        atomic_cas=atomic_cas,
        fence_system=lambda: None,
        globaltimer=time.time_ns,
        bits_to_f32=bits_to_f32,
        f32_to_bits=f32_to_bits,
        f16x2_to_f32=f16x2_to_f32,
        f32x2_to_f16x2=f32x2_to_f16x2,
        f32x2_to_bf16x2=f32x2_to_bf16x2,
    )


def device(fn):
    """Mark a device helper: an inlined ``cuda.jit`` device function, or in the simulator the
    plain function itself."""
    if SIMULATOR:
        return fn
    from numba import cuda

    return cuda.jit(device=True, forceinline=True)(fn)


def launch_bounded(max_threads: int):
    """Mark a kernel: ``cuda.jit`` with a launch bound of ``max_threads`` threads per block
    (the simulator's ``jit`` takes none)."""
    def jit(fn):
        from numba import cuda

        return cuda.jit(fn) if SIMULATOR else cuda.jit(launch_bounds=max_threads)(fn)

    return jit


_impl = _simulated() if SIMULATOR else _compiled()

griddep_launch_dependents = _impl.griddep_launch_dependents
griddep_wait = _impl.griddep_wait
load_volatile_v4_u32 = _impl.load_volatile_v4_u32
store_volatile_v4_u32 = _impl.store_volatile_v4_u32
store_volatile_v2_u32 = _impl.store_volatile_v2_u32
load_v4_u32 = _impl.load_v4_u32
load_v4_f32 = _impl.load_v4_f32
load_v4_i32 = _impl.load_v4_i32
load_v2_f64 = _impl.load_v2_f64
store_v4_u32 = _impl.store_v4_u32
store_v4_f32 = _impl.store_v4_f32
store_v4_i32 = _impl.store_v4_i32
store_v2_f64 = _impl.store_v2_f64
load_u8 = _impl.load_u8
load_u16 = _impl.load_u16
load_u32 = _impl.load_u32
load_i32 = _impl.load_i32
load_i64 = _impl.load_i64
load_f32 = _impl.load_f32
load_f64 = _impl.load_f64
store_u8 = _impl.store_u8
store_u16 = _impl.store_u16
store_u32 = _impl.store_u32
store_i64 = _impl.store_i64
store_f32 = _impl.store_f32
store_f64 = _impl.store_f64
load_acquire = _impl.load_acquire
red_release_add = _impl.red_release_add
red_relaxed_add = _impl.red_relaxed_add
atomic_add = _impl.atomic_add
atomic_cas = _impl.atomic_cas
fence_system = _impl.fence_system
globaltimer = _impl.globaltimer
bits_to_f32 = _impl.bits_to_f32
f32_to_bits = _impl.f32_to_bits
f16x2_to_f32 = _impl.f16x2_to_f32
f32x2_to_f16x2 = _impl.f32x2_to_f16x2
f32x2_to_bf16x2 = _impl.f32x2_to_bf16x2
