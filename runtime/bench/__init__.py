"""holeblend-bench: hole mode vs standard CacheBlend vs full prefill on a real model."""
