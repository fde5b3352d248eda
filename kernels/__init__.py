"""Numba CUDA code: Atom device functions and the executor kernel (imported lazily).

Nothing here is imported by ``import purlin``; the sm datapath imports it when first used, so the
package works on machines without CUDA.
"""
