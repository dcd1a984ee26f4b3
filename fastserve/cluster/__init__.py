"""The fleet on Ray Serve: `fastserve serve --replicas N` (optional extra `fastserve-mlfq[cluster]`).

`cli` adds the flags (no Ray import); `app` starts a fleet: `replica` is the engine
deployment (each replica serves HTTP itself, its streams batched by `asgi`), `ingress` the
one HTTP endpoint in front, `router` its table of replicas around `fastserve.fleet`'s
policies, `proxy` its HTTP client to the replicas, `metrics` the fleet's `/metrics`.
"""
