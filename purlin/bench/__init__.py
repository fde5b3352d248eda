"""Benchmarks: sweeps of Purlin against NCCL and PyTorch symmetric memory (DESIGN.md §5).

Timing returns the same record type everywhere (median and quantiles in microseconds); tables
follow nccl-tests (size, count, type, redop, time, algbw, busbw, #wrong).
"""
