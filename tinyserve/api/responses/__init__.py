"""OpenAI's Responses API: a request as the chat request it means (``request.py``), its
events and output items (``shaper.py``), stored responses (``store.py``), routes."""
