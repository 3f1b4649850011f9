"""Many tinyserve processes under Ray Serve: prefix-aware routing with a load guard, retries
before the first token, health checks, autoscaling. Needs the ``ray`` extra
(``pip install 'tinyserve[ray]'``); nothing else in tinyserve imports this package."""
