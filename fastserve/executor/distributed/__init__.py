"""Tensor and pipeline parallelism on torch.distributed.

Rank r holds pipeline stage r // T and tensor-parallel rank r % T of that stage. Rank 0 (stage
0, tensor-parallel rank 0) is the driver: it runs the engine, the scheduler and the KV manager,
sends every other rank each iteration's plan (swap instructions included) and computes its own
shard like any other rank. Every rank owns the KV cache of its own heads and layers and carries
out the plan's swaps on it.

- `layout`: which rank holds what (pure Python).
- `env`: how the processes were launched (pure Python, imported by the CLI).
- `comm`: process groups and the object/tensor transport.
- `stage`: one rank's runner (its shard of the model and of the KV cache).
- `heartbeat`: bounded-time failure detection.
- `worker`: the loop ranks > 0 run.
- `executor`: the driver's executor (`execute`, and `submit` / `collect` for pipelining).
- `launch`: starting the processes (spawned locally, or by `torchrun`).
"""
