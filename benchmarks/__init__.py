"""Benchmarks for skyrl_structured: overhead, scale, concurrency, cancellation, goodput, profile.

Scripts, not tests: ``python -m benchmarks`` runs them all (``--quick`` for a seconds-long smoke
size); see docs/benchmarks.md.
"""
