"""fastserve's benchmark scripts, grouped by what they measure (docs/benchmarks.md indexes them).

Each script runs from the repository root as `python benchmarks/<group>/<script>.py`; this file
makes `benchmarks` a package so that a script may import another group's helpers
(`from benchmarks.serving.http_bench import replay`) once the repository root is on `sys.path`.
"""
