"""The one sm launch (``purlin.atom.sm_kernel``) that single-process clusters and process mode
share: where flags and their per-block slots are, what an error record says, and process
mode's prepared collective built on it -- on made-up addresses, no GPU (launchers record
their calls)."""

import types

import pytest
import torch

from purlin.atom.sm_kernel import Flags, RankKernel, describe, pack
from purlin.kernels import isa
from purlin.snac import plan
from purlin.spec import collectives

FLAGS = Flags(2, 2, 6, {0: 1000, 1: 2000}, slots={0: 5000, 1: 9000}, ll={0: (7000, 64)})


def _record(code, flag, expected=3, seen=1, peer=1, step=2):
    rec = [0] * isa.ERR_WIDTH
    rec[isa.E_CODE], rec[isa.E_FLAG], rec[isa.E_EXPECTED] = code, flag, expected
    rec[isa.E_SEEN], rec[isa.E_PEER], rec[isa.E_STEP] = seen, peer, step
    return rec


def test_flags_name_every_word_and_give_each_a_slot_per_block():
    # 2 ranks x 2 lanes of peer flags, then lane barriers
    assert [FLAGS.name(1000 + 8 * i) for i in range(6)] == [
        "flag(r0<-r0.l0)", "flag(r0<-r0.l1)", "flag(r0<-r1.l0)", "flag(r0<-r1.l1)",
        "lane barrier 0 of rank 0", "lane barrier 1 of rank 0"]
    assert FLAGS.locate(2016) == (1, 2) and FLAGS.locate(2048) == (-1, -1)
    assert FLAGS.slot(2016) == 9000 + 2 * isa.F_MAX_BLOCKS * 8
    with pytest.raises(Exception, match="no flag with a slot per block"):
        FLAGS.slot(3000)
    assert FLAGS.ll_rank(7000 + 63) == 0 and FLAGS.ll_rank(7064) is None


def test_an_error_record_reads_as_one_sentence():
    assert describe([0] * isa.ERR_WIDTH, 0, FLAGS, 2.0) is None
    timeout = describe(_record(isa.ERR_TIMEOUT, 1016), 0, FLAGS, 2.0, adds=3, ask=True)
    assert timeout == ("rank 0 step 2 (lane 0, block 0) timed out after 2 s waiting on "
                       "flag(r0<-r1.l0) from rank 1: expected >= 3 (1 notifies x 3 blocks), "
                       "saw 1 — is rank 1 alive?")
    ll = describe(_record(isa.ERR_TIMEOUT, 7008, expected=1, seen=0), 0, FLAGS, 0.5)
    assert ll.endswith("waiting for the LL data rank 1 sends into r0's LL area: expected "
                       "tag 1, saw 0")
    aborted = describe(_record(isa.ERR_ABORTED, 1016), 0, FLAGS, 2.0, ask=True)
    assert "gave up waiting on flag(r0<-r1.l0) from rank 1: another rank timed out" in aborted
    sums = describe(_record(isa.ERR_TIMEOUT, 40 + 32), 1, FLAGS, 2.0, sums=(40, 64))
    assert sums.startswith("rank 1 block 0 gave up after 2 s waiting for row sum slot 2 of the "
                           "RMSNorm epilogue")


def test_a_launch_packs_its_ranks_programs_at_one_stride_and_counts_calls():
    import numpy as np

    table, stride, counters = pack(torch, torch.device("cpu"),
                                   [np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int64)],
                                   stride=4)
    assert stride == 5 and table.tolist() == [0, 1, 2, 0, 0, 0, 1, 2, 3, 4]
    assert counters.numel() == 2 * isa.F_MAX_BLOCKS and not counters.any()
    calls = []
    control = torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64)
    k = RankKernel(0, [3], lambda *a: calls.append(a), table.data_ptr(), counters.data_ptr(),
                   [control], keep=[table, counters, None])
    k.launch(7, 100)
    k.launch(7, 100, desc=123, launcher=lambda *a: calls.append(("other",) + a))
    assert calls == [(table.data_ptr(), 7, 100, counters.data_ptr()),
                     ("other", 123, 7, 100, counters.data_ptr())]
    assert k.errors(FLAGS, 2.0) == []
    control[2 + isa.E_CODE], control[2 + isa.E_FLAG], control[2 + isa.E_PEER] = \
        isa.ERR_TIMEOUT, 2000, 0
    [(rank, rec)] = k.records()
    assert rank == 3 and rec[isa.E_CODE] == isa.ERR_TIMEOUT and len(k.keep) == 2
    [(rank, code, why)] = k.errors(FLAGS, 2.0)
    assert (rank, code) == (3, isa.ERR_TIMEOUT)
    assert why.startswith("rank 3 step 0 (lane 0, block 0) timed out after 2 s waiting on "
                          "flag(r1<-r0.l0) from rank 0")


class _Launcher:
    def __init__(self, **config):
        self.config, self.calls = config, []
        # the words of a program a block loads into shared memory (as Launcher's)
        self.head_words = config.get("stride_words", 0)
        self.nranks_in_launch = config.get("nranks_in_launch", 1)

    def __call__(self, *args):
        self.calls.append(args)


def _path(monkeypatch):
    """An ``SmPath`` of rank 0 of 2 whose staging is host memory (peers' at made-up
    addresses) and whose launchers record their calls."""
    from purlin.atom.sm import Gpu
    from purlin.kernels import launch
    from purlin.torch.sm_path import SmPath

    monkeypatch.setattr(launch, "Launcher", _Launcher)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=9))

    path = object.__new__(SmPath)
    path.group, path.rank, path.nranks, path.timeout = None, 0, 2, 2.0
    path.device = torch.device("cpu", 0)
    path.blocks_per_lane, path.threads = None, 512
    path.gpu, path.sms = Gpu(0, 132), 132
    path.buf = torch.zeros(1 << 20, dtype=torch.uint8)
    path.ptrs = [path.buf.data_ptr(), 1 << 44]
    path._launchers, path.prepared = {}, []
    return path


@pytest.mark.parametrize("protocol", ["simple", "ll", "fused", "fused-ll"])
def test_process_mode_prepares_one_rank_kernel_and_names_its_errors(protocol, monkeypatch):
    from purlin.runtime.shm import layout

    s = plan(collectives.all_reduce(2), "direct-push", count=2048, dtype="bfloat16")
    lay = layout(s, ll=protocol in ("ll", "fused-ll"), block_flags=protocol.startswith("fused"))
    path = _path(monkeypatch)
    p = path.prepare(s, 0, lay, protocol=protocol)
    k = p.kernel
    assert k.ranks == [0] and k.control == [p.control] and p.error() is None
    fused = protocol.startswith("fused")
    assert k.launcher.config.get("kernel", "executor") == ("fused" if fused else "executor")
    assert (k.counters != 0) == fused  # the fused kernel's call counters
    if fused:  # flags have their slots in the layout's area
        assert p.flags.slots == {q: path.ptrs[q] + lay.block_flags for q in range(2)}
    p.launch()
    assert k.launcher.calls == [(k.desc, 9, p.timeout_ns, k.counters)]
    # rank 1 never notified rank 0's flag from it
    flag = path.ptrs[0] + lay.flags + 8 * s.lanes  # flag(r0<-r1.l0)
    p.control[2 + isa.E_CODE], p.control[2 + isa.E_FLAG] = isa.ERR_TIMEOUT, flag
    adds = 1 if fused else p.blocks_per_lane  # the fused kernel: a slot per block
    p.control[2 + isa.E_PEER], p.control[2 + isa.E_EXPECTED] = 1, 2 * adds
    assert p.error().startswith(f"rank 0 step 0 (lane 0, block 0) timed out after 2 s waiting "
                                f"on flag(r0<-r1.l0) from rank 1: expected >= {2 * adds} (2 "
                                f"notifies x {adds} blocks), saw 0")
    assert p.error().endswith("is rank 1 alive?")


@pytest.mark.parametrize("protocol,kernel", [("fused-ll", "epilogue-"), ("fused", "fused-norm")])
def test_process_mode_ends_a_program_with_the_norm_on_the_same_launch(protocol, kernel,
                                                                      monkeypatch):
    """all_reduce_add_rms_norm's program: another program and launcher on the same call
    counters (the one-shot kernel of ``rms_norm`` on LL, else the fused kernel's NORM op)."""
    from purlin.runtime.shm import layout

    s = plan(collectives.all_reduce(2), "direct-push", count=4096, dtype="bfloat16")
    lay = layout(s, ll=protocol == "fused-ll", block_flags=True)
    p = _path(monkeypatch).prepare(s, 0, lay, protocol=protocol, row_bytes=2048)
    norm = (torch.zeros(4096, dtype=torch.bfloat16), torch.ones(1024, dtype=torch.bfloat16), 1e-5)
    assert p.norm_problem(None, None, norm) is None and p.epilogues() == 1
    p.launch(norm=norm)
    (launcher,) = {v[1] for v in p._moved.values()}
    assert launcher.config["kernel"].startswith(kernel) and p.kernel.launcher.calls == []
    [(desc, stream, _, counters)] = launcher.calls
    assert desc != p.kernel.desc and counters == p.kernel.counters != 0
    # the launcher loads the whole program, the epilogue's extra words too
    (program,) = {v[0] for v in p._moved.values()}
    assert launcher.config["stride_words"] >= program.numel()
    if kernel == "epilogue-":  # (longer than the collective's programs: the case that broke)
        assert program.numel() > p.program_words
