"""`holeblend-serve`: the blend engine behind an OpenAI-compatible HTTP server.

Modules: `settings` (flags and HOLEBLEND_SERVE_* variables), `live_config` (blend.json and
its live keys), `requests` (request bodies -> typed requests, 400s naming the field),
`worker` (the one compute thread and its bounded queue), `metrics` (Prometheus series),
`responses` (OpenAI response bodies and SSE chunks), `app` (the aiohttp routes),
`cli` (the console script). See docs/serving.md.
"""
