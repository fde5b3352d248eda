"""Every runtime mistake gets a clear answer before anything runs, and torch tensors on a cpu
cluster come back as torch tensors."""

from __future__ import annotations

import numpy as np
import pytest

import purlin
from purlin.errors import ExecutionError, PurlinError, SpecError
from purlin.runtime import Cluster
from purlin.spec import collectives


def _outputs(n: int, count: int) -> list[np.ndarray]:
    return [np.full(count, -7.0) for _ in range(n)]


@pytest.mark.parametrize("timeout", [-1, 0, 0.0, float("nan"), float("inf"), "5", None, True])
def test_bind_refuses_a_timeout_that_is_not_a_finite_positive_number(timeout):
    with pytest.raises(SpecError, match="timeout must be a finite number of seconds > 0") as e:
        Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64",
                            timeout=timeout)
    assert repr(timeout) in str(e.value)
    assert isinstance(e.value, PurlinError)


@pytest.mark.parametrize("timeout", [-1, float("nan"), "5"])
def test_run_refuses_a_bad_timeout_and_leaves_the_inputs_alone(timeout):
    xs = [np.arange(4.0), np.ones(4)]
    before = [x.copy() for x in xs]
    with pytest.raises(SpecError, match=r"timeout .* got "):
        purlin.run(collectives.all_reduce(2), xs, timeout=timeout)
    assert all(np.array_equal(x, b) for x, b in zip(xs, before))


def test_a_good_timeout_binds_and_runs():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64", timeout=1)
    outs = bound([np.arange(4.0), np.ones(4)])
    assert [o.tolist() for o in outs] == [[1.0, 2.0, 3.0, 4.0]] * 2


@pytest.mark.parametrize("n", [True, False, 0, -2, 2.0, "2", None])
def test_cluster_cpu_takes_only_a_rank_count(n):
    with pytest.raises(SpecError, match="Cluster.cpu takes a number of ranks, an int >= 1") as e:
        Cluster.cpu(n)
    assert repr(n) in str(e.value)


@pytest.mark.parametrize("n", [True, 0])
def test_cluster_virtual_and_local_take_only_a_rank_count(n):
    # refused before any GPU is looked for, so the same answer on a machine without one
    with pytest.raises(SpecError, match="Cluster.virtual takes a number of ranks"):
        Cluster.virtual(n)
    with pytest.raises(SpecError, match="Cluster.local takes a number of ranks"):
        Cluster.local(n)


def test_run_with_too_few_inputs_says_how_many_it_needs():
    x = np.arange(4.0)
    with pytest.raises(ExecutionError, match=r"all-reduce on 2 ranks needs 2 inputs .* got 1"):
        purlin.run(collectives.all_reduce(2), [x])
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_run_with_too_many_inputs_says_how_many_it_needs():
    with pytest.raises(ExecutionError, match="needs 2 inputs .* got 3"):
        purlin.run(collectives.all_gather(2), [np.ones(2)] * 3)


def test_bound_call_with_the_wrong_input_count_writes_no_output():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
    out = _outputs(2, 4)
    with pytest.raises(ExecutionError, match="needs 2 inputs, got 1"):
        bound([np.ones(4)], out=out)
    assert all((o == -7.0).all() for o in out)


def test_bound_call_with_a_wrong_length_writes_no_output():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
    out = _outputs(2, 4)
    with pytest.raises(ExecutionError, match="input of rank 1 has 3 elements; .* expects 4"):
        bound([np.ones(4), np.ones(3)], out=out)
    assert all((o == -7.0).all() for o in out)


def test_bound_call_with_the_wrong_dtype_writes_no_output():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
    out = _outputs(2, 4)
    with pytest.raises(ExecutionError, match="input of rank 0 is float32; this binding moves "
                                             "float64"):
        bound([np.ones(4, np.float32), np.ones(4, np.float32)], out=out)
    assert all((o == -7.0).all() for o in out)


def test_bound_call_refuses_in_place_and_leaves_the_buffers_alone():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float64")
    xs = [np.arange(4.0), np.ones(4)]
    with pytest.raises(ExecutionError, match="output of rank 0 shares memory with an input"):
        bound(xs, out=[xs[0], np.zeros(4)])
    assert xs[0].tolist() == [0.0, 1.0, 2.0, 3.0] and xs[1].tolist() == [1.0] * 4


def test_an_unknown_datapath_is_refused_with_the_choices():
    with pytest.raises(PurlinError, match="datapath 'bogus' cannot run on Cluster.cpu.*cpu, ce, "
                                          "auto"):
        Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, datapath="bogus")


# ---- torch tensors in, torch tensors out

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_cpu_cluster_returns_tensors_for_tensors(dtype):
    tdt = getattr(torch, dtype)
    xs = [torch.arange(6, dtype=tdt).reshape(2, 3), torch.ones(2, 3, dtype=tdt)]
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=6, dtype=dtype)
    outs = bound(xs)
    for o in outs:
        assert isinstance(o, torch.Tensor)
        assert o.dtype == tdt and o.shape == (2, 3) and o.device == xs[0].device
        assert torch.equal(o, xs[0] + xs[1])
    assert torch.equal(xs[1], torch.ones(2, 3, dtype=tdt))  # inputs untouched


def test_run_returns_tensors_for_tensors_and_a_gathered_output_is_flat():
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    res = purlin.run(collectives.all_gather(2), xs)
    for o in res.outputs:
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
        assert o.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_torch_outputs_given_are_written_in_place():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float32")
    out = [torch.zeros(4), torch.zeros(2, 2).t()]  # the second not contiguous
    got = bound([torch.ones(4), torch.full((4,), 2.0)], out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert out[0].tolist() == [3.0] * 4 and out[1].flatten().tolist() == [3.0] * 4


def test_torch_input_of_the_wrong_dtype_is_refused_before_anything_is_written():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float32")
    out = [torch.full((4,), -7.0), torch.full((4,), -7.0)]
    with pytest.raises(ExecutionError, match="input of rank 0 is float64"):
        bound([torch.ones(4, dtype=torch.float64)] * 2, out=out)
    assert all(torch.equal(o, torch.full((4,), -7.0)) for o in out)


def test_a_bfloat16_tensor_is_refused_by_name_before_anything_is_written():
    bound = Cluster.cpu(2).bind(collectives.all_reduce(2), count=4, dtype="float32")
    out = [torch.full((4,), -7.0), torch.full((4,), -7.0)]
    with pytest.raises(ExecutionError, match="input of rank 0 is bfloat16; this binding moves "
                                             "float32"):
        bound([torch.ones(4, dtype=torch.bfloat16)] * 2, out=out)
    with pytest.raises(ExecutionError, match="output of rank 1 must hold 4 float32 elements, "
                                             "got 4 bfloat16"):
        bound([torch.ones(4)] * 2, out=[out[0], torch.zeros(4, dtype=torch.bfloat16)])
    assert all(torch.equal(o, torch.full((4,), -7.0)) for o in out)


def test_purlin_run_refuses_bfloat16_on_the_cpu_datapath_with_what_to_use():
    with pytest.raises(PurlinError, match="not bfloat16 .*use the sm datapath on a GPU"):
        purlin.run(collectives.all_reduce(2), [torch.ones(4, dtype=torch.bfloat16)] * 2)
