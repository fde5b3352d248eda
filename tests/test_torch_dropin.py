"""purlin.torch as a drop-in for torch.distributed: the same calls side by side on a gloo group.

Every function purlin.torch offers runs next to torch.distributed's own on the same inputs, for
every dtype x op (sum, max, min, avg, and PRODUCT, which falls back) x size (odd ones
included), on 2, 3 and 4 ranks: the results are equal, the same tensors are written (reduce
leaves non-roots alone, where gloo writes them), and every signature form of torch 2.13 is
accepted (positional and keyword arguments, ``group=``, ``async_op=True`` returning a finished
work, ``group_src=`` / ``group_dst=``, the ``*_single`` names, a group with a communicator of
its own and one without). Each rank count spawns its processes once and runs every case in
them; the 2-rank matrix runs unmarked, 3 and 4 ranks are ``slow``.
"""

from __future__ import annotations

import inspect
import time
import warnings

import pytest

from purlin.torch.testing import raise_for, run_processes

DTYPES = ("float32", "float16", "bfloat16", "int32", "float64")
OPS = ("SUM", "MAX", "MIN", "AVG", "PRODUCT")
SIZES = (1, 7, 1000, 4099)
FUNCTIONS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
             "all_to_all_single", "broadcast", "reduce")


def test_every_function_has_torch_distributed_signature():
    """Same parameter names, order, kinds and defaults as torch.distributed's (torch 2.13),
    for every function both offer; the *_single names exist where torch has them."""
    import torch.distributed as dist

    import purlin.torch as pt

    for name in FUNCTIONS:
        if not hasattr(dist, name):
            assert not hasattr(pt, name), name
            continue
        theirs = inspect.signature(getattr(dist, name)).parameters
        ours = inspect.signature(getattr(pt, name)).parameters
        assert [(p.name, p.kind, str(p.default)) for p in ours.values()] == \
            [(p.name, p.kind, str(p.default)) for p in theirs.values()], name
        method = inspect.signature(getattr(pt.Communicator, name)).parameters
        assert list(method)[1:] == list(theirs), name


# -- workers (run in the spawned processes) --------------------------------------------------------


def _data(torch, rank, salt, count, dtype, op="SUM"):
    """Small integers, exact in every dtype (sums and products of 4 ranks included)."""
    gen = torch.Generator().manual_seed(7919 * salt + 101 * rank + count)
    lo, hi = (-2, 3) if op == "PRODUCT" else (-8, 9)
    return torch.randint(lo, hi, (count,), generator=gen).to(getattr(torch, dtype))


class _Case:
    """One call made twice on clones of the same tensors: torch.distributed's, then purlin's;
    the outcome compared (results, which tensors changed)."""

    def __init__(self, torch, bad, label):
        self.torch, self.bad, self.label = torch, bad, label

    def run(self, make, theirs, ours, compare=None, check_work=False):
        torch = self.torch
        orig = make()
        a = [t.clone() for t in orig]
        b = [t.clone() for t in orig]
        theirs(*a)
        got = ours(*b)
        if check_work:
            if got is None or not got.wait() or not got.is_completed():
                self.bad.append(f"{self.label}: async_op=True gave {got!r}")
        elif got is not None:
            self.bad.append(f"{self.label}: returned {got!r}, torch.distributed returns None")
        for i in (compare if compare is not None else range(len(orig))):
            if not torch.equal(a[i], b[i]):
                self.bad.append(f"{self.label} arg {i}: purlin {b[i].flatten()[:6].tolist()} "
                                f"torch {a[i].flatten()[:6].tolist()}")
            elif torch.equal(a[i], orig[i]) != torch.equal(b[i], orig[i]):
                self.bad.append(f"{self.label} arg {i}: written by one, not the other")
        return orig, a, b


def _forms(pt, dist, rank, n):
    """Each function's call forms: (name, call(args, op, root) -> result, async?)."""
    W = dist.group.WORLD
    return {
        "all_reduce": [
            ("positional", lambda t, op: pt.all_reduce(t, op, None, False), False),
            ("keywords", lambda t, op: pt.all_reduce(tensor=t, op=op, group=W), False),
            ("async", lambda t, op: pt.all_reduce(t, op=op, async_op=True), True)],
        "all_gather_into_tensor": [
            ("positional", lambda o, i: pt.all_gather_into_tensor(o, i, None, False), False),
            ("keywords", lambda o, i: pt.all_gather_into_tensor(output_tensor=o,
                                                                input_tensor=i, group=W), False),
            ("single async", lambda o, i: pt.all_gather_single(o, i, async_op=True), True)],
        "reduce_scatter_tensor": [
            ("positional", lambda o, i, op: pt.reduce_scatter_tensor(o, i, op, None, False),
             False),
            ("keywords", lambda o, i, op: pt.reduce_scatter_tensor(output=o, input=i, op=op,
                                                                   group=W), False),
            ("single async", lambda o, i, op: pt.reduce_scatter_single(o, i, op,
                                                                       async_op=True), True)],
        "all_to_all_single": [
            ("positional", lambda o, i: pt.all_to_all_single(o, i, None, None, None, False),
             False),
            ("keywords", lambda o, i: pt.all_to_all_single(output=o, input=i, group=W), False),
            ("async", lambda o, i: pt.all_to_all_single(o, i, async_op=True), True)],
    }


def _matrix(torch, dist, pt, rank, n, sizes, dtypes, ops, bad):
    R = dist.ReduceOp
    forms = _forms(pt, dist, rank, n)
    k = 0

    def form(fn):
        nonlocal k
        k += 1
        return forms[fn][k % len(forms[fn])]

    for dtype in dtypes:
        for opname in ops:
            op = getattr(R, opname)
            if opname == "AVG" and dtype == "int32":
                continue  # torch raises for it (tests/test_bad_input_torch.py)
            for count in sizes:
                tag = f"{dtype} {opname} n={count}"
                # all_reduce
                name, call, is_async = form("all_reduce")
                _Case(torch, bad, f"all_reduce {tag} ({name})").run(
                    lambda: [_data(torch, rank, 1, count, dtype, opname)],
                    lambda t: dist.all_reduce(t, op=op),
                    lambda t: call(t, op), check_work=is_async)
                # reduce_scatter_tensor and the list form
                name, call, is_async = form("reduce_scatter_tensor")
                _Case(torch, bad, f"reduce_scatter_tensor {tag} ({name})").run(
                    lambda: [torch.full((count,), -5, dtype=getattr(torch, dtype)),
                             _data(torch, rank, 2, count * n, dtype, opname)],
                    lambda o, i: dist.reduce_scatter_single(o, i, op=op),
                    lambda o, i: call(o, i, op), check_work=is_async)
                _Case(torch, bad, f"reduce_scatter {tag}").run(
                    lambda: [torch.full((count,), -5, dtype=getattr(torch, dtype))] + list(
                        _data(torch, rank, 3, count * n, dtype, opname).chunk(n)),
                    lambda o, *ins: dist.reduce_scatter(o, list(ins), op=op),
                    lambda o, *ins: pt.reduce_scatter(o, list(ins), op))
                # reduce: gloo writes scratch into non-roots; purlin leaves them as they were
                if count in (1, sizes[-1]):
                    for root in (0, n - 1):
                        by_group = (count + root) % 2 == 0
                        orig, _, b = _Case(torch, bad, f"reduce {tag} root {root}").run(
                            lambda: [_data(torch, rank, 4, count, dtype, opname)],
                            lambda t: dist.reduce(t, dst=root, op=op),
                            (lambda t: pt.reduce(t, op=op, group_dst=root)) if by_group else
                            (lambda t: pt.reduce(t, root, op, None, False)),
                            compare=[0] if rank == root else [])
                        if rank != root and not torch.equal(orig[0], b[0]):
                            bad.append(f"reduce {tag} root {root}: non-root written")
        # the functions without an op
        for count in sizes:
            tag = f"{dtype} n={count}"
            name, call, is_async = form("all_gather_into_tensor")
            _Case(torch, bad, f"all_gather_into_tensor {tag} ({name})").run(
                lambda: [torch.full((count * n,), -5, dtype=getattr(torch, dtype)),
                         _data(torch, rank, 5, count, dtype)],
                lambda o, i: dist.all_gather_single(o, i),
                lambda o, i: call(o, i), check_work=is_async)
            _Case(torch, bad, f"all_gather {tag}").run(
                lambda: [_data(torch, rank, 6, count, dtype)] + [
                    torch.full((count,), -5, dtype=getattr(torch, dtype)) for _ in range(n)],
                lambda t, *outs: dist.all_gather(list(outs), t),
                lambda t, *outs: pt.all_gather(list(outs), t))
            name, call, is_async = form("all_to_all_single")
            _Case(torch, bad, f"all_to_all_single {tag} ({name})").run(
                lambda: [torch.full((count * n,), -5, dtype=getattr(torch, dtype)),
                         _data(torch, rank, 7, count * n, dtype)],
                lambda o, i: dist.all_to_all_single(o, i),
                lambda o, i: call(o, i), check_work=is_async)
            for root in (0, n - 1):
                forms_b = [lambda t: pt.broadcast(t, root),
                           lambda t: pt.broadcast(t, group_src=root, async_op=False),
                           lambda t: pt.broadcast(tensor=t, src=root, group=None)]
                _Case(torch, bad, f"broadcast {tag} root {root}").run(
                    lambda: [_data(torch, rank, 8, count, dtype)],
                    lambda t: dist.broadcast(t, src=root),
                    forms_b[(count + root) % 3])


def _extras(torch, dist, pt, rank, n, bad):
    """What the matrix does not cover: a leaf that requires grad, a strided view, NaN under
    MAX, a subgroup with its own communicator, a group without one, uneven all-to-all splits."""
    # a leaf that requires grad: written in place, as torch does, still a leaf
    x, ref = torch.ones(5, requires_grad=True), torch.ones(5, requires_grad=True)
    pt.all_reduce(x)
    dist.all_reduce(ref)
    if not (torch.equal(x, ref) and x.requires_grad and x.grad_fn is None and x.is_leaf):
        bad.append(f"requires_grad leaf: {x}, torch gives {ref}")
    y = torch.ones(4, requires_grad=True) * 3  # not a leaf
    pt.all_reduce(y)
    if not torch.equal(y.detach(), torch.full((4,), 3.0 * n)):
        bad.append(f"requires_grad non-leaf: {y}")
    # a strided view: the view reduced, the rest of its storage untouched
    base = torch.arange(12.0).reshape(3, 4) + rank
    ref = base.clone()
    pt.all_reduce(base[:, 1])
    dist.all_reduce(ref[:, 1].contiguous())
    want = (torch.arange(12.0).reshape(3, 4)[:, 1] * n + sum(range(n)))
    if not (torch.equal(base[:, 1], want) and torch.equal(base[:, 0], ref[:, 0])):
        bad.append(f"strided view: {base}")
    # NaN under MAX: NaN wherever any rank has one (torch.maximum); gloo depends on the order
    t = torch.arange(4.0) + rank
    t[rank % 4] = float("nan")
    every = torch.empty(n * 4)
    dist.all_gather_single(every, t)
    pt.all_reduce(t, dist.ReduceOp.MAX)
    want = every.view(n, 4).amax(0)  # amax propagates NaN
    if not torch.equal(t.isnan(), want.isnan()) or not torch.equal(
            t[~t.isnan()], want[~want.isnan()]):
        bad.append(f"NaN under MAX: {t.tolist()}, torch.maximum gives {want.tolist()}")
    # a subgroup with its own communicator (every rank makes the group, members the comm)
    members = [0, n - 1]
    sub = dist.new_group(members)
    if rank in members:
        comm = pt.init(sub, datapath="cpu", timeout=20)
        t, ref = torch.arange(6.0) * (rank + 1), torch.arange(6.0) * (rank + 1)
        pt.all_reduce(t, group=sub)
        dist.all_reduce(ref, group=sub)
        if not torch.equal(t, ref) or not comm.plans():
            bad.append(f"subgroup all_reduce: {t.tolist()} vs {ref.tolist()}")
        t = torch.full((3,), float(rank))
        pt.broadcast(t, group_src=1, group=sub)  # group rank 1 is global rank n - 1
        if not torch.equal(t, torch.full((3,), float(n - 1))):
            bad.append(f"subgroup broadcast group_src=1: {t.tolist()}")
        comm.close()
    # a group without a communicator: torch.distributed runs it, warned once
    other = dist.new_group(list(range(n)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for _ in range(2):
            t = torch.ones(3)
            pt.all_reduce(t, group=other)
            if not torch.equal(t, torch.full((3,), float(n))):
                bad.append(f"group without a communicator: {t.tolist()}")
    said = [str(w.message) for w in caught if "no purlin.torch communicator" in str(w.message)]
    if len(said) != 1:
        bad.append(f"group without a communicator warned {said}")
    # uneven all-to-all splits: torch.distributed's result
    splits = [(rank + j) % 3 for j in range(n)]
    outs = [(j + rank) % 3 for j in range(n)]
    inp = torch.arange(float(sum(splits))) + 100 * rank
    a, b = torch.zeros(sum(outs)), torch.zeros(sum(outs))
    dist.all_to_all_single(a, inp, outs, splits)
    pt.all_to_all_single(b, inp, outs, splits)
    if not torch.equal(a, b):
        bad.append(f"uneven all-to-all: {b.tolist()} vs {a.tolist()}")


def _dropin_worker(rank, n, sizes, dtypes, ops):
    import torch
    import torch.distributed as dist

    import purlin.torch as pt

    t0 = time.monotonic()
    comm = pt.init(datapath="cpu", timeout=30)
    bad: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        warnings.simplefilter("ignore", FutureWarning)
        _matrix(torch, dist, pt, rank, n, sizes, dtypes, ops, bad)
        _extras(torch, dist, pt, rank, n, bad)
    fallbacks = [str(w.message) for w in caught if "falls back" in str(w.message)]
    kinds = sorted({p["function"] for p in comm.plans() if "unprepared" not in p})
    comm.check()
    comm.close()
    return {"bad": bad, "fallbacks": fallbacks, "kinds": kinds, "seconds": time.monotonic() - t0}


def _check(results):
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: {len(res['bad'])} differences: {res['bad'][:6]}"
        warned = res["fallbacks"]
        assert len(warned) == len(set(warned)), "a fallback warned twice"
        text = " | ".join(warned)
        for reason in ("reduce op PRODUCT", "dtype bfloat16"):
            assert reason in text, (reason, warned)
        assert all("torch.distributed (gloo)" in w or "no purlin.torch communicator" in w
                   for w in warned), warned
        # what Purlin itself ran (the rest fell back, said above)
        assert res["kinds"] == ["all-gather", "all-reduce", "all-to-all", "broadcast",
                                "reduce", "reduce-scatter"], res["kinds"]


def test_dropin_equals_torch_distributed_on_two_ranks():
    t0 = time.monotonic()
    _check(raise_for(run_processes(_dropin_worker, 2, SIZES, DTYPES, OPS, timeout=240)))
    assert time.monotonic() - t0 < 200


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 4])
def test_dropin_equals_torch_distributed_on_three_and_four_ranks(n):
    _check(raise_for(run_processes(_dropin_worker, n, SIZES, DTYPES, OPS, timeout=400)))
