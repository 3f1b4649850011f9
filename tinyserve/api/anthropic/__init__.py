"""Anthropic's Messages API: wire types, the chat request a Messages request means
(``request.py``), the answer in Anthropic's events (``shaper.py``), routes."""
