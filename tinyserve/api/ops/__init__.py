"""The operator's routes, which run no model: probes and /metrics, the live route table,
LoRA adapters loaded and unloaded, and the OpenAPI document."""
