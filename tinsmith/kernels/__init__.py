"""Compute kernels with a plain torch implementation beside each fast one (the reference in tests)."""
