"""holeblend kernels: Triton kernels with torch references and device dispatch."""
