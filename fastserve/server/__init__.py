"""The OpenAI-compatible HTTP server.

`fastserve.server.app.build_app(llm, ...)` makes the FastAPI app; `fastserve serve` (in
`fastserve.server.cli`) runs it. Nothing is imported here, so that the CLI, which imports
`fastserve.server.cli` to register the `serve` command, does not load the web stack.
"""
