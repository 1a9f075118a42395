"""KV tiers: the in-process store, the node directory, the shared tier, stores in the background."""
