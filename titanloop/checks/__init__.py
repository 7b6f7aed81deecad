"""Acceptance checks that are part of the library: the numerical checks of the fast path (titanloop.checks.numerics),
which scripts/gpu_check.py runs on CUDA and tests/ on CPU."""
