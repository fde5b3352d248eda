"""CommOptions(deterministic=True) on purlin.torch.Communicator in process mode (gloo + the shm
cpu datapath, one process per rank): all-reduce and reduce-scatter of order-sensitive float32
data give the rank-order sum's bits whatever the strategy; a group spanning nodes is refused."""

from __future__ import annotations

import pytest

from purlin.torch.testing import raise_for, run_processes

WORLD = 4


def _order_sensitive(np, count, call):
    gen = np.random.default_rng(call)
    return [((10.0 ** gen.uniform(-4, 4, count)) * gen.choice([-1.0, 1.0], count)).astype(
        np.float32) for _ in range(WORLD)]


def _worker(rank, n):
    import numpy as np
    import torch

    from purlin.torch import CommOptions, Communicator

    bad = []
    for strategy in ("auto", "direct-push", "direct-pull", "two-phase"):
        comm = Communicator(datapath="cpu", timeout=20,
                            options=CommOptions(strategy=strategy, deterministic=True))
        for call, count in enumerate((7, 64, 1001, 64)):
            xs = _order_sensitive(np, count, call)
            want = xs[0].copy()
            for x in xs[1:]:
                want += x  # float32, rank order, one rounding per add: the deterministic sum
            t = torch.from_numpy(xs[rank].copy())
            comm.all_reduce(t)
            if not np.array_equal(t.numpy().view(np.uint32), want.view(np.uint32)):
                bad.append(f"{strategy} all_reduce count {count}")
            if count % n == 0:
                out = torch.empty(count // n, dtype=torch.float32)
                comm.reduce_scatter_tensor(out, torch.from_numpy(xs[rank].copy()))
                mine = want[rank * (count // n):(rank + 1) * (count // n)]
                if not np.array_equal(out.numpy().view(np.uint32), mine.view(np.uint32)):
                    bad.append(f"{strategy} reduce_scatter count {count}")
        comm.close()
    return bad


def test_deterministic_communicator_gives_the_rank_order_bits_on_every_strategy():
    for rank, bad in enumerate(raise_for(run_processes(_worker, WORLD, timeout=120))):
        assert bad == [], f"rank {rank}: {bad}"


def _spanning_worker(rank, n):
    from purlin.errors import CapabilityError
    from purlin.torch import CommOptions, Communicator

    try:
        Communicator(datapath="cpu", timeout=20, node_of_rank=(0, 0, 1, 1),
                     options=CommOptions(deterministic=True))
    except CapabilityError as exc:
        return str(exc)
    return None


def test_a_group_spanning_nodes_is_refused_with_the_reason():
    for why in raise_for(run_processes(_spanning_worker, WORLD, timeout=60)):
        assert why and "runs on one node" in why and "node by node" in why, why


def test_deterministic_must_be_a_bool():
    from purlin.errors import SpecError
    from purlin.torch import CommOptions

    with pytest.raises(SpecError, match="deterministic must be True or False"):
        CommOptions(deterministic=1)
