"""Development and test support for holeblend: a Kubernetes API emulator, the demo, benchmarks.

Nothing here is imported by the operator or the runtime at run time.
"""
