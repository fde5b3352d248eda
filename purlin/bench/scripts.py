"""What the scripts under bench/ share: the environment of a GPU run and where results go.

Each script reproduces one published table with one command and writes its JSON under
``outputs/`` (git-ignored) unless ``--out`` names another file or folder.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> output(d / "x", "sweep.json").name, output(d / "y.json", "sweep.json").name
('sweep.json', 'y.json')
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OUTPUTS = Path("outputs")

# NVLink multicast (NVLS) off for NCCL and PyTorch symmetric memory, as in every published
# run: a baseline that switched algorithm with the machine would not be comparable; and the 32
# hardware queues per device the copy-engine datapath needs, set before anything starts CUDA
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def gpu_env() -> None:
    """Set :data:`GPU_ENV` where the caller has not (before torch starts NCCL)."""
    for key, value in GPU_ENV.items():
        os.environ.setdefault(key, value)


def output(out, name: str) -> Path:
    """The JSON file a script writes: ``out`` itself when it ends in .json, else ``name``
    inside the folder ``out`` (default ``outputs/``); parent folders are created."""
    out = Path(out) if out else OUTPUTS
    path = out if out.suffix == ".json" else out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def folder(out) -> Path:
    """The folder a script writes several files into (default ``outputs/``), created."""
    path = Path(out) if out else OUTPUTS
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path, obj) -> Path:
    """Write ``obj`` as indented JSON (anything unknown as text); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return path


def run_info(datapath: str = "sm", seconds: float | None = None, **fields) -> dict:
    """The environment of a run (date, commit, versions, GPUs: ``purlin.bench.sweep.environment``),
    what was measured (unless ``fields`` say) and how long it took, with ``fields``, for a
    script's JSON."""
    from purlin.bench.sweep import environment

    try:
        env = environment(datapath="cpu" if datapath == "cpu" else "sm")
    except Exception as exc:  # noqa: BLE001 - the table stands without it
        env = {"environment": f"unavailable: {exc}"}
    info = {**env,
            "measured": ("CUDA-graph replay, device time per op (median)" if datapath != "cpu"
                         else "cpu datapath, wall time per call: not GPU numbers"), **fields}
    if seconds is not None:
        info["seconds"] = round(seconds, 1)
    return info


def missing_gpus(n: int, script: str) -> str | None:
    """Why ``script``, which runs one rank per GPU, cannot run ``n`` ranks here (None: it
    can); the scripts print it and exit with status 2 instead of failing inside a spawn."""
    from purlin.bench.clusters import gpu_count

    have = gpu_count()
    if have >= n:
        return None
    return (f"{script} runs one rank per GPU: it needs {n} GPUs and {have} "
            f"{'is' if have == 1 else 'are'} visible (on one GPU, `purlin bench -n {n}` "
            "measures virtual ranks)")
