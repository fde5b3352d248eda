"""environment.yml, pyproject.toml and dev.sh ask for the same dependencies with the same pins."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

yaml = pytest.importorskip("yaml")
try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# torch stays out of environment.yml: GPU users bring their own CUDA build (see its header)
ONLY_IN_PYPROJECT = {"torch"}


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pyproject_requirements() -> dict:
    """Every requirement of the package and its extras, by name; self-references expanded."""
    project = pyproject()["project"]
    found: dict = {}
    lists = [project["dependencies"], *project["optional-dependencies"].values()]
    for text in (t for lst in lists for t in lst):
        req = Requirement(text)
        if canonicalize_name(req.name) == "purlin":
            continue
        name = canonicalize_name(req.name)
        entry = (req.specifier, frozenset(req.extras))
        assert found.setdefault(name, entry) == entry, f"{name} is pinned two ways in pyproject"
    return found


def environment():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def conda_requirement(text: str) -> tuple[str, SpecifierSet]:
    name, spec = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", text.strip()).groups()
    if re.fullmatch(r"=[^=<>!].*", spec):  # conda's "name=1.2" means 1.2.*
        spec = "==" + spec[1:] + ".*"
    return canonicalize_name(name), SpecifierSet(spec.replace(" ", ""))


def environment_requirements() -> dict:
    found: dict = {}
    for dep in environment()["dependencies"]:
        if isinstance(dep, dict):
            for text in dep["pip"]:
                if text.startswith("-e"):
                    continue
                req = Requirement(text)
                found[canonicalize_name(req.name)] = (req.specifier, frozenset(req.extras))
        else:
            name, spec = conda_requirement(dep)
            found[name] = (spec, frozenset())
    found.pop("pip")
    return found


def test_environment_uses_conda_forge_only():
    assert environment()["channels"] == ["conda-forge"]


def test_environment_python_satisfies_requires_python():
    env = environment_requirements()
    python_spec = env["python"][0]
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    version = str(python_spec).removeprefix("==").removesuffix(".*")
    assert requires.contains(version), (version, requires)


def test_same_dependencies_and_pins():
    ours = pyproject_requirements()
    env = environment_requirements()
    env.pop("python")
    missing = sorted(set(ours) - set(env) - ONLY_IN_PYPROJECT)
    extra = sorted(set(env) - set(ours))
    assert not missing, f"in pyproject.toml but not environment.yml: {missing}"
    assert not extra, f"in environment.yml but not pyproject.toml: {extra}"
    for name in sorted(set(ours) & set(env)):
        assert env[name] == ours[name], (
            f"{name}: pyproject.toml asks for {ours[name]}, environment.yml for {env[name]}")


def test_numpy_range_is_1_24_through_2_5_everywhere():
    for spec, _ in (pyproject_requirements()["numpy"], environment_requirements()["numpy"]):
        assert spec.contains("1.24.0") and spec.contains("2.4.6") and spec.contains("2.5.2")
        assert not spec.contains("1.23.5") and not spec.contains("2.6.0")


def test_numba_accepts_the_numpy_range_we_claim():
    """numba (which numba-cuda brings) states the NumPy it supports: ours must lie inside."""
    metadata = pytest.importorskip("importlib.metadata")
    try:
        requires = metadata.requires("numba") or []
    except metadata.PackageNotFoundError:
        pytest.skip("numba is not installed (pip install -e .[test])")
    (numpy_req,) = [Requirement(r) for r in requires if Requirement(r).name == "numpy"]
    for version in ("1.24.0", "2.4.6", "2.5.2"):
        assert numpy_req.specifier.contains(version), (version, numpy_req)


SIMULATED_NUMPY_2_5 = """
import sys
import numpy as np
if hasattr(np, "row_stack"):  # NumPy < 2.5: remove it as 2.5 did
    del np.row_stack
from purlin.kernels import compat
if sys.argv[1] == "without-compat":
    compat.ensure_numpy_compat = lambda: None
from numba import cuda, types

def add_one(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1

try:
    ptx = compat.compile_ptx(add_one, (types.float32[::1],))
except AttributeError as exc:
    print("AttributeError:", exc)
else:
    print("compiled", ".entry" in ptx, hasattr(np, "row_stack"))
"""


@pytest.mark.parametrize("mode", ["without-compat", "with-compat"])
def test_kernels_compat_makes_numba_cuda_compile_without_row_stack(mode):
    """NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30.4 calls it on its first compile.
    With the alias removed from the NumPy installed here, the compile fails as it does on 2.5
    (the control) and succeeds once ``kernels/compat.py`` has restored it. The GPU runs use
    NumPy 2.5.2 itself."""
    pytest.importorskip("numba.cuda")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SIMULATED_NUMPY_2_5, mode],
                          capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    if mode == "without-compat":
        assert "AttributeError: module 'numpy' has no attribute 'row_stack'" in done.stdout
    else:
        assert done.stdout.strip() == "compiled True True", done.stdout + done.stderr


def test_environment_installs_the_package_with_test_extras():
    pip = next(d["pip"] for d in environment()["dependencies"] if isinstance(d, dict))
    editable = [t for t in pip if t.startswith("-e")]
    assert len(editable) == 1
    extras = set(re.search(r"\[(.*)\]", editable[0]).group(1).split(","))
    assert {"notebook", "test"} <= extras


def test_dev_sh_torch_pin_satisfies_the_gpu_extra():
    pin = re.search(r'TORCH_PIN="(torch==[^"]+)"', (ROOT / "dev.sh").read_text()).group(1)
    version = Requirement(pin).specifier
    gpu_torch = pyproject_requirements()["torch"][0]
    (exact,) = list(version)
    assert gpu_torch.contains(exact.version), (pin, gpu_torch)
