"""Files the server reads, parsed without torch and within bounds: GGUF (``gguf.py``).
Imported by text/ (a GGUF's tokenizer), engine/ (its config and tensors) and cli/ (its size)."""
