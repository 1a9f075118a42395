"""holeblend runtime: segments, hole lookup, blending, KV stores and engines."""
