"""Hardware profiles for the cost model: per-hop latency α, link and HBM bandwidth, overheads.

Bandwidths are bytes per second in one direction. On an NVSwitch machine (``topology
"switch"``) every GPU has one port to the switch fabric, ``link_bandwidth`` per direction,
aggregated over its NVLinks; every transfer out of a GPU shares its send side, every transfer
into it the receive side. ``"mesh"`` gives every ordered pair of GPUs a link of its own.
``"gpu"`` is the virtual ranks of one GPU: every transfer, a peer's or a rank's own, reads its
sources and writes its destination in that GPU's memory, whose ``hbm_bandwidth`` (bytes read
plus written) all of them share.

>>> PROFILES["H200"].link_bandwidth / 1e9
450.0
>>> p = get_profile("A100").replace(alpha_ns=1500.0)
>>> Profile.from_json(p.to_json()) == p
True
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from purlin.errors import SpecError

TOPOLOGIES = ("switch", "mesh", "gpu")

# α is no datasheet figure: the flag hop between two GPUs measured 2–3 µs on 2×H200
# (ARCHITECTURE.md). The datasheet profiles use 2 µs until calibrate() measures the machine.
ASSUMED_ALPHA_NS = 2000.0
# per-step issue cost in the executor kernel (table fetch, syncthreads): assumed, not measured
ASSUMED_STEP_NS = 100.0


@dataclass(frozen=True)
class Profile:
    """The cost model's view of a machine; see :func:`purlin.trace.model.predict`.

    * ``link_bandwidth`` — bytes/s per direction of a link (a GPU's switch port, or a pair's
      direct link on a mesh), shared fairly by the transfers that use it;
    * ``alpha_ns`` — from a Notify's end to the release of the wait it satisfies;
    * ``hbm_bandwidth`` — bytes/s of a GPU's memory for local copies and reductions
      (``inf``: free);
    * ``step_ns`` — issue cost of every step; ``launch_ns`` — fixed cost before any lane
      starts (kernel launch, graph node).
    """

    name: str
    link_bandwidth: float
    alpha_ns: float
    hbm_bandwidth: float = math.inf
    step_ns: float = 0.0
    launch_ns: float = 0.0
    topology: str = "switch"
    source: str = ""

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise SpecError(f"profile {self.name!r}: topology must be one of "
                            f"{', '.join(TOPOLOGIES)}, got {self.topology!r}")
        for label in ("link_bandwidth", "hbm_bandwidth"):
            if not getattr(self, label) > 0:
                raise SpecError(f"profile {self.name!r}: {label} must be > 0 bytes/s, got "
                                f"{getattr(self, label)!r}")
        for label in ("alpha_ns", "step_ns", "launch_ns"):
            if not getattr(self, label) >= 0:
                raise SpecError(f"profile {self.name!r}: {label} must be >= 0, got "
                                f"{getattr(self, label)!r}")

    def replace(self, **changes) -> "Profile":
        return replace(self, **changes)

    def __repr__(self) -> str:
        hbm = "inf" if math.isinf(self.hbm_bandwidth) else f"{self.hbm_bandwidth / 1e12:.3g} TB/s"
        return (f"Profile({self.name}: link {self.link_bandwidth / 1e9:.4g} GB/s per direction "
                f"({self.topology}), alpha {self.alpha_ns / 1e3:.3g} us, HBM {hbm}, step "
                f"{self.step_ns:.4g} ns, launch {self.launch_ns / 1e3:.3g} us)")

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, obj) -> "Profile":
        if isinstance(obj, str):
            obj = json.loads(obj)
        fields = cls.__dataclass_fields__
        unknown = set(obj) - set(fields)
        if unknown:
            raise SpecError(f"a profile has no field(s) {', '.join(sorted(unknown))}")
        return cls(**{k: (math.inf if v == "inf" else v) for k, v in obj.items()})

    def save(self, path) -> Path:
        """Write the profile as JSON; :meth:`load` reads it back."""
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "Profile":
        return cls.from_json(Path(path).read_text())


_GB, _TB = 1e9, 1e12

PROFILES: dict[str, Profile] = {p.name: p for p in (
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): NVLink 600 GB/s (both directions,
    # 12 third-generation links), GPU memory bandwidth 2,039 GB/s (HBM2e).
    Profile("A100", 300 * _GB, ASSUMED_ALPHA_NS, 2039 * _GB, ASSUMED_STEP_NS,
            source="NVIDIA A100 Tensor Core GPU datasheet: NVLink 600 GB/s, HBM2e 2,039 GB/s "
                   "(SXM4 80GB); alpha and step assumed"),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): NVLink 900 GB/s (both directions,
    # 18 fourth-generation links), GPU memory bandwidth 3.35 TB/s (HBM3).
    Profile("H100", 450 * _GB, ASSUMED_ALPHA_NS, 3.35 * _TB, ASSUMED_STEP_NS,
            source="NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s, HBM3 3.35 TB/s "
                   "(H100 SXM); alpha and step assumed"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): NVLink 900 GB/s (both directions,
    # 18 links), GPU memory bandwidth 4.8 TB/s (HBM3e).
    Profile("H200", 450 * _GB, ASSUMED_ALPHA_NS, 4.8 * _TB, ASSUMED_STEP_NS,
            source="NVIDIA H200 Tensor Core GPU datasheet: NVLink 900 GB/s, HBM3e 4.8 TB/s "
                   "(H200 SXM); alpha and step assumed"),
    # NVIDIA DGX B200 / HGX B200 datasheet: fifth-generation NVLink 1.8 TB/s per GPU (both
    # directions, 18 links), HBM3e 8 TB/s per GPU.
    Profile("B200", 900 * _GB, ASSUMED_ALPHA_NS, 8 * _TB, ASSUMED_STEP_NS,
            source="NVIDIA DGX B200 datasheet: NVLink 1.8 TB/s per GPU, HBM3e 8 TB/s per GPU; "
                   "alpha and step assumed"),
    # NVIDIA H100 PCIe datasheet: PCIe Gen5 128 GB/s (x16, both directions), GPU memory
    # bandwidth 2 TB/s; peer traffic goes through the PCIe switch / host bridge.
    Profile("PCIe-Gen5", 64 * _GB, 3000.0, 2 * _TB, ASSUMED_STEP_NS,
            source="NVIDIA H100 PCIe datasheet: PCIe Gen5 x16 128 GB/s, HBM 2 TB/s; alpha "
                   "(3 us, longer path than NVLink) and step assumed"),
    # Our own figures on 2×H200 SXM (ARCHITECTURE.md): cudaMemcpyPeer moves 390 GB/s one way;
    # a flag hop costs 2–3 µs; the naive one-shot all-reduce of 8 KiB took 4.5 µs per op under
    # CUDA graphs, which launch_ns + one hop + three steps reproduces.
    Profile("H200-measured", 390 * _GB, 2500.0, 4.8 * _TB, ASSUMED_STEP_NS, launch_ns=1700.0,
            source="measured on 2xH200 SXM (ARCHITECTURE.md): cudaMemcpyPeer 390 GB/s one way, "
                   "alpha 2-3 us, one-shot all-reduce 8 KiB 4.5 us under CUDA graphs"),
    # Virtual ranks of one H200: a device copy moves about 4.3 TB/s read plus written; alpha
    # and step fitted to the per-strategy times of purlin tune's virtual-rank table
    # (runtime/tuning/nvidia-h200.json, 48 entries: 4 and 8 ranks, six collectives, 8 KiB to
    # 16 MiB): the strategy it ranks first measured 1.010x the fastest there (geomean; past
    # 1.15x only at the 8-rank 1 MiB reduce-scatter, 1.19x; tests/test_trace_model.py).
    Profile("H200-virtual", math.inf, 2000.0, 4.3 * _TB, 800.0, launch_ns=2500.0,
            topology="gpu",
            source="measured on virtual ranks of one H200: device copy 4.3 TB/s read + "
                   "written; alpha and step fitted to the virtual-rank tuning table's "
                   "per-strategy times"),
)}


def get_profile(profile) -> Profile:
    """A :class:`Profile` given itself, a registered name (``"H200"``) or a JSON file path."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, str) and profile in PROFILES:
        return PROFILES[profile]
    if isinstance(profile, (str, Path)) and Path(profile).is_file():
        return Profile.load(profile)
    raise SpecError(f"unknown hardware profile {profile!r}; registered: "
                    f"{', '.join(PROFILES)} (or pass a Profile or a JSON file saved by "
                    "Profile.save)")
