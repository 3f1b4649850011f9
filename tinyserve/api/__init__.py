"""The HTTP face: one folder per API (``openai/``, ``responses/``, ``anthropic/``) over one
shared pipeline (auth, decode, prepare, generate, SSE), and the operator's routes (``ops/``).
Never imports torch or engine/ (tests/test_layering.py). ``app.py`` lists every route and the
module that answers it."""
