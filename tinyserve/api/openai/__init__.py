"""OpenAI's API, with vLLM's extensions: chat completions and completions (``routes.py``;
the chat path the other fronts translate to), their wire types, field policy and shapers,
the model list and vLLM's tokenize / detokenize."""
