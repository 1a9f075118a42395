"""The per-BlendDeployment lookup server: an index of cached segments and where they live.

Run it as `holeblend-lookup --host H --port P` or `python -m holeblend_runtime.lookup_server`
(the same command line). It imports no torch: it runs in a small CPU pod. The wire
format is in `wire.py`, the index in `index.py`, the HTTP server in `server.py`.
"""
