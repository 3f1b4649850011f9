"""``python -m tinyserve.fleet [fleet options] [-- server options]``: N tinyserve replicas
under Ray Serve behind one OpenAI-compatible endpoint. Everything after ``--`` goes to each
replica's ``python -m tinyserve`` (model, KV budget, tenants, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading

from tinyserve.fleet.app import FleetConfig

APP = "tinyserve"

HELP = {
    "replicas": "a fixed number of replicas (no autoscaling)",
    "min_replicas": "autoscaling floor",
    "max_replicas": "autoscaling ceiling (autoscaling is on when it is above the floor)",
    "initial_replicas": "replicas at start (default: the floor)",
    "target_ongoing_requests": "Serve adds replicas while requests in flight per replica "
                               "(running + queued in the server) stay above this",
    "upscale_delay_s": "how long load must stay high before a replica is added",
    "downscale_delay_s": "how long load must stay low before a replica is removed",
    "num_gpus": "GPUs per replica (1 on a GPU machine)",
    "num_cpus": "CPUs per replica",
    "max_ongoing_requests": "requests Serve sends one replica at once",
    "balance_abs_threshold": "load guard: the prefix owner is skipped when it has this many "
                             "more requests than the least loaded replica ...",
    "balance_rel_threshold": "... and more than this many times its load",
    "kv_high": "load guard: also skipped at this KV usage while another replica is below",
    "match_rate_threshold": "share of the prompt a prefix match must cover to count",
    "route_timeout_s": "a request no replica accepts within this gets 503",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tinyserve.fleet", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (e.g. auto); default: start a local one")
    p.add_argument("--replicas", type=int, default=None, help=HELP["replicas"])
    defaults = FleetConfig()
    for f in dataclasses.fields(FleetConfig):
        if f.name == "server_args":
            continue
        kind = int if f.type in ("int", "int | None") else float
        p.add_argument("--" + f.name.replace("_", "-"), type=kind,
                       default=getattr(defaults, f.name) if f.name != "initial_replicas"
                       else None, help=HELP.get(f.name, " "))
    return p


def config_from_args(argv: list[str]) -> tuple[argparse.Namespace, FleetConfig]:
    server_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FleetConfig)
              if f.name != "server_args"}
    if args.replicas is not None:
        values.update(min_replicas=args.replicas, max_replicas=args.replicas,
                      initial_replicas=args.replicas)
    try:
        cfg = FleetConfig(server_args=server_args, **values)
    except ValueError as e:
        build_parser().error(str(e))
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    import ray
    from ray import serve

    from tinyserve.fleet.app import build

    ray.init(address=args.address, include_dashboard=False)
    stop = threading.Event()  # after ray.init, which installs handlers of its own
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # On a cluster where Serve already runs, its HTTP options stay what they are.
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build(cfg), name=APP, route_prefix="/")
        logging.info("fleet up (%d-%d replicas): POST /v1/completions and /v1/chat/completions "
                     "on Serve's HTTP proxy (asked for http://%s:%d)", cfg.min_replicas,
                     cfg.max_replicas, args.host, args.port)
        stop.wait()
        logging.info("shutting down: replicas drain their requests")
    finally:
        if args.address is None:
            serve.shutdown()  # our own local cluster: all of it
        else:
            serve.delete(APP)  # a shared cluster keeps its other applications
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
