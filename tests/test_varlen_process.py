"""Variable-length all-to-all in process mode (cpu datapath, gloo group): all_to_all_single with
split sizes on Purlin (no fallback) and all_to_all_v with the splits in a tensor, against
torch.distributed; bad splits end in a CountError naming the rank."""

from __future__ import annotations

import pytest

from purlin.torch.testing import raise_for, run_processes

WORLD = 3


def _worker(rank, n):
    import warnings

    import torch
    import torch.distributed as dist

    from purlin.errors import CallMismatchError, CountError
    from purlin.torch import Communicator

    comm = Communicator(datapath="cpu", timeout=20)
    bad = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for dtype in (torch.float32, torch.int32, torch.float64):
            for style in ("mixed", "zero", "full", "rows"):
                cap = 4
                if style == "zero":
                    send = [0] * n
                elif style == "full":
                    send = [cap] * n
                else:
                    send = [(rank * 2 + j) % (cap + 1) for j in range(n)]
                recv = [(j * 2 + rank) % (cap + 1) if style in ("mixed", "rows") else send[0]
                        for j in range(n)]
                shape = (3,) if style == "rows" else ()
                inp = (torch.arange(sum(send) * (3 if shape else 1)) + 100 * rank).to(dtype)
                inp = inp.reshape(sum(send), *shape)
                a = torch.full((sum(recv), *shape), -1, dtype=dtype)
                b = a.clone()
                dist.all_to_all_single(a, inp, recv, send)
                comm.all_to_all_single(b, inp, recv, send)
                if not torch.equal(a, b):
                    bad.append(f"all_to_all_single {dtype} {style}: {b.tolist()} vs {a.tolist()}")
                # the device-splits variant: fixed buffers, the counts come back
                out = torch.full((n * cap, *shape), -1, dtype=dtype)
                got = comm.all_to_all_v(out, inp, torch.tensor(send), capacity=cap)
                if got.tolist() != recv or not torch.equal(out[:sum(recv)], a):
                    bad.append(f"all_to_all_v {dtype} {style}: {got.tolist()} {out.tolist()}")
        # a receiver that expects other rows than its sender sends
        send = [1] * n
        recv = [1] * n
        if rank == 1:
            recv = [2] + [1] * (n - 2) + [0]
        try:
            comm.all_to_all_single(torch.zeros(sum(recv)), torch.ones(n), recv, send)
            if rank == 1:
                bad.append("mismatched splits ran")
        except CallMismatchError as exc:
            if rank != 1 or "rank 1 expects 2 rows from rank 0" not in str(exc):
                bad.append(f"mismatch message: {exc}")
    errors = {}
    for label, fn in (
            ("negative", lambda: comm.all_to_all_single(torch.zeros(n), torch.zeros(n),
                                                        [1] * n, [2, -1] + [1] * (n - 2))),
            ("wrong length", lambda: comm.all_to_all_single(torch.zeros(n), torch.zeros(n),
                                                            [1] * n, [1] * (n + 1))),
            ("sum", lambda: comm.all_to_all_single(torch.zeros(n), torch.zeros(n),
                                                   [1] * n, [2] * n)),
            ("over capacity", lambda: comm.all_to_all_v(torch.zeros(n * 2), torch.zeros(n * 3),
                                                        torch.tensor([3] + [0] * (n - 1)),
                                                        capacity=2)),
            ("tensor length", lambda: comm.all_to_all_v(torch.zeros(n * 2), torch.zeros(2),
                                                        torch.tensor([1]), capacity=2))):
        try:
            fn()
            errors[label] = "ran"
        except CountError as exc:
            errors[label] = str(exc)
    # only rank 1 passes a split over capacity: the others must not hang
    try:
        comm.all_to_all_v(torch.zeros(n * 2), torch.zeros(n * 3),
                          torch.tensor([3 if rank == 1 else 1] + [1] * (n - 1)), capacity=2)
        one_bad = "ran"
    except CountError:
        one_bad = "raised"
    out = torch.zeros(n * 2)
    got = comm.all_to_all_v(out, torch.full((n,), float(rank)), torch.ones(n, dtype=torch.int64),
                            capacity=2)
    after = "ok" if got.tolist() == [1] * n and out[:n].tolist() == list(map(float, range(n))) \
        else f"wrong: {got.tolist()} {out.tolist()}"
    fell = [str(w.message) for w in caught if "falls back" in str(w.message)]
    comm.close()
    return {"bad": bad, "fallbacks": fell, "errors": errors, "one bad": one_bad, "after": after}


def test_splits_run_on_purlin_and_equal_torch_distributed():
    results = raise_for(run_processes(_worker, WORLD, timeout=180))
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: {res['bad'][:4]}"
        assert res["fallbacks"] == [], res["fallbacks"]
        e = res["errors"]
        assert f"rank {rank}: all_to_all_single: input_split_sizes must be {WORLD} whole " \
               "numbers >= 0" in e["negative"], e
        assert f"must be {WORLD} whole numbers" in e["wrong length"], e
        assert f"input_split_sizes [2, 2, 2] sum to 6 rows but the input has {WORLD}" in \
            e["sum"], e
        assert f"rank {rank} chunk ({rank},0) (its split for rank 0): split 3 is over the " \
               "capacity of 2 rows (caught by the pack; 2 rows were sent)" in \
            e["over capacity"], e
        # one rank's bad split: every rank still completes the call, that rank raises
        assert res["one bad"] == ("raised" if rank == 1 else "ran"), res["one bad"]
        assert res["after"] == "ok", res["after"]
        assert "takes input_splits as an integer tensor of 3 rows" in e["tensor length"], e


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
