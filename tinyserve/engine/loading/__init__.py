"""A checkpoint into the model's weights and description: config.json (or a GGUF's metadata)
into one ModelConfig for every family, safetensors or GGUF tensors into one layer layout,
quantized as asked; the random-weight demo model."""
