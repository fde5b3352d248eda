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


def test_numpy_stays_below_2_5_everywhere():
    for spec, _ in (pyproject_requirements()["numpy"], environment_requirements()["numpy"]):
        assert not spec.contains("2.5.0") and spec.contains("2.4.0") and spec.contains("1.26.4")


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
