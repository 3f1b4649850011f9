"""Tool calls: the request's tools and tool_choice (``plan.py``), a format's calls parsed
from output (``parsers.py``), and a choice's output as content and calls (``output.py``)."""
