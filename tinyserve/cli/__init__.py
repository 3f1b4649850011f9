"""The command line: flags (``flags.py``) and their values (``values.py``), the tenants file
(``tenants.py``) and the served models (``models.py``) into configuration; ``main.py`` runs
the server with it. Nothing here is imported by the server itself."""
