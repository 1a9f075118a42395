"""Contracts shared by the operator and the runtime (files, wire formats, names).

The operator never imports the runtime and the runtime never imports the operator, so what
both sides must agree on lives here, once. This package imports nothing of holeblend's and
no heavy dependency (no torch, no kopf): only the standard library and pydantic.
"""
