"""The HTTP face: OpenAI-compatible routes over the actors. Never imports torch or engine/
(tests/test_layering.py). ``app.py`` lists every route and the module that answers it."""
