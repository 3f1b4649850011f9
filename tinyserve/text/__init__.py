"""Text without torch: tokenizer and chat templates, the incremental detokenizer, grammars for
structured output. The API and the engine core import it; it imports neither."""
