"""The forward pass over the kernels: weights as the kernels hold them, a decoder layer as a
mixer (attention) and a feed-forward (dense MLP) between norms, rotary tables, the KV layout,
LoRA on the device."""
