"""Fit the cost model's α and β (and optionally the launch and step costs) to measurements.

A measurement is a schedule and the time one call of it took, in ns (on GPUs: the median of
CUDA-graph replays). The predicted latency is piecewise linear in α, 1/β, ``launch_ns`` and
``step_ns`` (linear as long as the same steps stay on the critical path), so a few
Gauss-Newton rounds of non-negative least squares land on the best fit.

>>> from purlin.spec import collectives
>>> from purlin.snac import plan
>>> from purlin.trace.model import predict_latency
>>> from purlin.trace.profiles import Profile
>>> truth = Profile("truth", link_bandwidth=200e9, alpha_ns=1800.0)
>>> runs = [plan(collectives.all_gather(4), "ring", nbytes=b) for b in (4096, 1 << 20, 1 << 24)]
>>> guess = truth.replace(alpha_ns=3000.0, link_bandwidth=450e9)
>>> fitted = calibrate([(s, predict_latency(s, truth)) for s in runs], base=guess)
>>> round(fitted.alpha_ns), round(fitted.link_bandwidth / 1e9)
(1800, 200)
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np

from purlin.errors import SpecError
from purlin.snac.ir import Schedule
from purlin.trace.model import predict_latency
from purlin.trace.profiles import Profile, get_profile

FITTABLE = ("alpha_ns", "link_bandwidth", "launch_ns", "step_ns")
_LOWER = {"alpha_ns": 0.0, "inv_link": 1e-7, "launch_ns": 0.0, "step_ns": 0.0}


def calibrate(measurements, schedules: Sequence[Schedule] | None = None, *,
              base="H200-measured", fit: Iterable[str] = ("alpha_ns", "link_bandwidth"),
              name: str = "calibrated", path=None, rounds: int = 10) -> Profile:
    """A profile whose predictions fit ``measurements`` best (least squares on the ns).

    ``measurements`` is a sequence of ``(schedule, measured_ns)`` pairs, or a callable
    ``measure(schedule) -> ns`` that runs a schedule, used on every one of ``schedules``.
    ``fit`` names the fields to fit (of ``alpha_ns``, ``link_bandwidth``, ``launch_ns``,
    ``step_ns``); the others come from ``base``. With ``path`` the profile is saved as JSON
    there (read it back with ``Profile.load``). Mix small messages (they pin α) with large
    ones (they pin β).
    """
    pairs = _pairs(measurements, schedules)
    fit = tuple(fit)
    unknown = set(fit) - set(FITTABLE)
    if unknown or not fit:
        raise SpecError(f"calibrate fits some of {', '.join(FITTABLE)}; got {fit!r}")
    profile = get_profile(base).replace(name=name)
    measured = np.array([t for _, t in pairs], dtype=np.float64)
    theta = _coords(profile, fit)
    for _ in range(rounds):
        predicted = _latencies(pairs, profile)
        jac = np.empty((len(pairs), len(fit)))
        for j in range(len(fit)):
            step = max(abs(theta[j]) * 1e-3, 1e-3 if fit[j] != "link_bandwidth" else 1e-9)
            moved = theta.copy()
            moved[j] += step
            jac[:, j] = (_latencies(pairs, _profile(profile, fit, moved)) - predicted) / step
        new = theta + _nonneg_lstsq(jac, measured - predicted, theta, fit)
        done = np.allclose(new, theta, rtol=1e-9, atol=1e-12)
        theta, profile = new, _profile(profile, fit, new)
        if done:
            break
    residual = measured - _latencies(pairs, profile)
    rms = float(np.sqrt(np.mean(residual ** 2)))
    profile = profile.replace(source=f"calibrate(): {', '.join(fit)} fitted to {len(pairs)} "
                                     f"measurement(s), rms residual {rms:.4g} ns; the rest "
                                     f"from {get_profile(base).name}")
    if path is not None:
        profile.save(path)
    return profile


def _pairs(measurements, schedules) -> list[tuple[Schedule, float]]:
    if callable(measurements):
        if not schedules:
            raise SpecError("calibrate(measure, schedules): give the schedules to measure")
        pairs = [(s, float(measurements(s))) for s in schedules]
    else:
        pairs = [(s, float(t)) for s, t in measurements]
    if not pairs:
        raise SpecError("calibrate needs at least one (schedule, measured ns) pair")
    return pairs


def _latencies(pairs, profile: Profile) -> np.ndarray:
    return np.array([predict_latency(s, profile) for s, _ in pairs])


def _coords(profile: Profile, fit) -> np.ndarray:
    """The fitted fields as linear coordinates (bandwidth as ns per byte)."""
    return np.array([1e9 / profile.link_bandwidth if f == "link_bandwidth" else
                     getattr(profile, f) for f in fit], dtype=np.float64)


def _profile(profile: Profile, fit, theta) -> Profile:
    return profile.replace(**{f: (1e9 / v if f == "link_bandwidth" else float(v))
                              for f, v in zip(fit, theta)})


def _nonneg_lstsq(jac, rhs, theta, fit) -> np.ndarray:
    """The least-squares change of ``theta`` that keeps every coordinate at or above its lower
    bound: the unconstrained answer if feasible, else the best over the ways of pinning some
    coordinates to their bounds (at most four coordinates: 16 ways)."""
    lower = np.array([_LOWER["inv_link" if f == "link_bandwidth" else f] for f in fit])
    best, best_cost = None, np.inf
    k = len(fit)
    for pinned in itertools.chain.from_iterable(itertools.combinations(range(k), m)
                                                for m in range(k + 1)):
        delta = np.zeros(k)
        delta[list(pinned)] = lower[list(pinned)] - theta[list(pinned)]
        free = [j for j in range(k) if j not in pinned]
        if free:
            sol, *_ = np.linalg.lstsq(jac[:, free], rhs - jac @ delta, rcond=None)
            delta[free] = sol
        if np.any(theta + delta < lower - 1e-12):
            continue
        cost = float(np.sum((jac @ delta - rhs) ** 2))
        if best is None or cost < best_cost:
            best, best_cost = delta, cost
        if not pinned and best is not None:
            return best  # unconstrained and feasible
    return best if best is not None else np.zeros(k)

