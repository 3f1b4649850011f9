"""The fleet as a Ray Serve application: ``FleetIngress`` in front of ``TinyserveReplica``.

Two ways in: ``python -m tinyserve.fleet`` (tinyserve/fleet/__main__.py), or Serve's own CLI
with a config file that names ``tinyserve.fleet.app:build_app`` (deploy/ray/serve.yaml).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tinyserve.fleet.replica import check_server_args

ROUTER_CLASS = "tinyserve.fleet.router.PrefixLoadRouter"


@dataclass
class FleetConfig:
    """Every knob of the fleet; ``server_args`` go to each replica's ``python -m tinyserve``."""

    server_args: list[str] = field(default_factory=list)
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None  # default: min_replicas
    # Autoscaling (on when max_replicas > min_replicas): Serve adds replicas while the
    # requests in flight per replica (queued in the server included) stay above this.
    target_ongoing_requests: float = 32.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    # Per replica: one GPU each on a GPU machine, a share of a CPU without one.
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    # Requests Serve sends one replica at once; default: the server's max-num-seqs +
    # max-waiting (from server_args), beyond which it would answer 429.
    max_ongoing_requests: int | None = None
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 10.0
    startup_timeout_s: float = 600.0
    # How long a replica being removed (downscale, redeploy) gives its requests to finish;
    # also the server's --drain-timeout. Set it above your longest request.
    drain_timeout_s: float = 30.0
    routing_stats_period_s: float = 1.0
    # Load guard (policy.LoadGuard) and prefix matching.
    balance_abs_threshold: float = 32.0
    balance_rel_threshold: float = 1.5
    kv_high: float = 0.95
    match_rate_threshold: float = 0.1
    # Ingress.
    ingress_replicas: int = 1
    max_body_bytes: int = 4 * 2**20
    route_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_replicas is None:
            self.initial_replicas = self.min_replicas
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas "
                             f"({self.max_replicas})")
        if not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas {self.initial_replicas} is outside "
                             f"[{self.min_replicas}, {self.max_replicas}]")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError("num_gpus and num_cpus must be >= 0")
        if not all(isinstance(a, str) for a in self.server_args):
            raise ValueError("server_args must be a list of strings")
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")
        check_server_args(self.server_args)
        server = self.parsed_server_args()
        if self.max_ongoing_requests is None:
            self.max_ongoing_requests = server.max_num_seqs + server.max_waiting
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")

    def parsed_server_args(self):
        """server_args as the server will read them (its defaults filled in)."""
        from tinyserve.cli.flags import build_parser

        try:
            return build_parser().parse_args(self.server_args)
        except SystemExit:
            raise ValueError(f"server_args are not valid server options: "
                             f"{' '.join(self.server_args)}") from None

    def replica_server_args(self) -> list[str]:
        """server_args, plus --drain-timeout from drain_timeout_s unless they set it."""
        if any(a.split("=", 1)[0] == "--drain-timeout" for a in self.server_args):
            return list(self.server_args)
        return [*self.server_args, "--drain-timeout", f"{self.drain_timeout_s:g}"]

    def shutdown_timeout_s(self) -> float:
        """Serve waits this long for a removed replica: its requests (drain_timeout_s), then
        the server's own drain and exit, with room to spare."""
        return 2 * self.drain_timeout_s + 10

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> FleetConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown fleet option(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**args)

    def deployment_options(self) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        opts: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.shutdown_timeout_s(),
            "request_router_config": RequestRouterConfig(
                request_router_class=ROUTER_CLASS,
                request_router_kwargs={
                    "balance_abs_threshold": self.balance_abs_threshold,
                    "balance_rel_threshold": self.balance_rel_threshold,
                    "kv_high": self.kv_high,
                    "match_rate_threshold": self.match_rate_threshold,
                },
                request_routing_stats_period_s=self.routing_stats_period_s,
                request_routing_stats_timeout_s=max(5.0, self.routing_stats_period_s * 5),
            ),
        }
        if self.max_replicas > self.min_replicas:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.initial_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": self.metrics_interval_s,
                "look_back_period_s": self.look_back_period_s,
            }
        else:
            opts["num_replicas"] = self.min_replicas
        return opts


def build(cfg: FleetConfig):
    """The Serve application (bound deployments) for ``cfg``."""
    from ray import serve

    from tinyserve.fleet.ingress import FleetIngress
    from tinyserve.fleet.replica import TinyserveReplica

    replica = serve.deployment(TinyserveReplica, name="TinyserveReplica",
                               **cfg.deployment_options())
    ingress = serve.deployment(FleetIngress, name="FleetIngress",
                               num_replicas=cfg.ingress_replicas,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)  # back-pressure is the replicas'
    return ingress.bind(replica.bind(cfg.replica_server_args(), cfg.startup_timeout_s,
                                     cfg.drain_timeout_s),
                        cfg.max_body_bytes, cfg.route_timeout_s, cfg.replica_server_args())


def build_app(args: dict[str, Any]):
    """Serve's application builder: ``import_path: tinyserve.fleet.app:build_app``."""
    return build(FleetConfig.from_dict(dict(args)))
