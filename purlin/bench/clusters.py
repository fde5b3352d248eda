"""Which cluster a measurement runs on, said in words, and which baselines it can run.

One rule everywhere (``purlin bench``, ``purlin run --datapath sm``, ``purlin trace --measure``):
``Cluster.best(n)`` — one GPU per rank when there are enough, else ``n`` virtual ranks on one
GPU (the sm datapath still runs), else the cpu datapath. The baselines (NCCL, PyTorch symmetric
memory) need one GPU per rank; on virtual ranks they are skipped with a reason.

>>> from purlin.runtime.cluster import Cluster
>>> describe(Cluster.cpu(2))
'cpu datapath, 2 ranks (numpy and host threads: not GPU numbers)'
>>> describe(Cluster("virtual", 4, (0,) * 4), names=["NVIDIA H200"])
'sm datapath, 4 virtual ranks on 1 x NVIDIA H200'
>>> baseline_reason("nccl", nranks=4, gpus=1)
'nccl needs one GPU per rank (4 ranks, 1 GPU visible); it is not run on virtual ranks'
"""

from __future__ import annotations


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 without torch or CUDA)."""
    try:
        from purlin.atom.sm import device_count

        return device_count()
    except Exception:
        return 0


def gpu_names(devices) -> list[str]:
    """The device names of ``devices`` (``"GPU <d>"`` where torch cannot say)."""
    out = []
    for d in devices:
        try:
            import torch

            out.append(torch.cuda.get_device_name(d))
        except Exception:
            out.append(f"GPU {d}")
    return out


def choose(n: int, datapath: str | None = None):
    """The cluster of ``n`` ranks a measurement runs on: ``datapath="cpu"`` forces the cpu
    datapath; otherwise ``Cluster.best(n)`` (GPUs, else virtual ranks on one GPU, else cpu)."""
    from purlin.runtime.cluster import Cluster

    return Cluster.cpu(n) if datapath == "cpu" else Cluster.best(n)


def describe(cluster, names=None) -> str:
    """One line naming the datapath, the ranks and the GPUs (``names``: the GPUs' names, by
    default asked of torch)."""
    if cluster.kind == "cpu":
        return (f"cpu datapath, {cluster.nranks} ranks (numpy and host threads: not GPU "
                "numbers)")
    devices = sorted(set(cluster.devices))
    names = list(names) if names is not None else gpu_names(devices)
    gpus = f"{len(devices)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    virtual = "virtual " if cluster.kind == "virtual" else ""
    return f"sm datapath, {cluster.nranks} {virtual}ranks on {gpus}"


def baseline_reason(kind: str, nranks: int, gpus: int) -> str | None:
    """Why baseline ``kind`` cannot run ``nranks`` ranks with ``gpus`` distinct GPUs (None: it
    can). NCCL and PyTorch symmetric memory run one process per GPU."""
    if gpus >= nranks:
        return None
    seen = f"{gpus} GPU{'s' if gpus != 1 else ''} visible" if gpus else "no GPU visible"
    where = "; it is not run on virtual ranks" if gpus >= 1 else ""
    return f"{kind} needs one GPU per rank ({nranks} ranks, {seen}){where}"
