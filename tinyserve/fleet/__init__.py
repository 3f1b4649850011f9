"""Many tinyserve replicas behind one router (issue 9). ``policy.py``: which replica serves a
request - the one holding its longest prompt prefix, unless that one is loaded well beyond the
others (SGLang's and vLLM's routers' cache-aware policy)."""
