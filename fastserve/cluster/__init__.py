"""The fleet on Ray Serve: `fastserve serve --replicas N` (optional extra `fastserve-mlfq[cluster]`).

`cli` adds the flags (no Ray import); `app` starts a fleet: `replica` is the engine
deployment, `router` the Ray Serve request routers around `fastserve.fleet`'s policies,
`ingress` the one HTTP endpoint in front, `asgi` carries a request to a replica's own app,
`metrics` the fleet's `/metrics`.
"""
