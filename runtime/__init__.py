"""holeblend runtime: the blend pipeline by stage (model, kv, blend, lookup_server, quality), the engine and its adapters (serve, vllm_connector)."""
