"""GPU benchmarks: real Qwen3 shapes with random weights, in-process and through the SDK.

``python -m bench.gpu.run --out DIR`` runs them all (see docs/gpu.md).
"""
