"""Benchmarks: workloads (Zipf/Gamma, trace replay), the runner, metrics, reports and plots."""
