"""The operator process's own configuration: the chart's values, passed as its container's
environment, read once at start-up (``__main__``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cosine_spec.pods import ImageSpec


@dataclass(frozen=True)
class OperatorConfig:
    """The operator process's own settings (chart values → container env), read once at start-up.

    ``webhook_port``: where the validating admission webhook listens (HTTPS), ``None`` = off.
    ``webhook_cert_dir``: ``tls.crt``/``tls.key`` for it (cert-manager or the chart's self-signed
    secret); empty = kopf generates a self-signed pair. ``webhook_insecure``: plain HTTP (tests).
    ``metrics_port``: the operator's Prometheus endpoint, ``None`` = off.
    ``scrape_timeout_s``: per-pod ``/metrics`` request timeout.
    ``tick_s``: how often each cluster's autoscaler daemon wakes, in seconds; it scrapes every
    ``spec.autoscaling.intervalSeconds`` and notices a changed spec or a deletion within a tick.
    ``namespace``, ``pod_labels``: the operator's own namespace and pod labels (the chart passes
    them: downward API, ``k=v,k=v``); the clusters' NetworkPolicies let such pods reach the
    metrics ports. Either empty: no such peer (the operator runs outside the cluster).
    ``peering_lifetime_s``: how long a replica's kopf peering record stays live without a
    keep-alive (``None``: kopf's 60 s). A standby takes over at most this long after the active
    replica dies without saying so (SIGKILL, a lost node); a replica that stops cleanly removes
    its record at once.
    ``resync_s``: how often each cluster's children are re-applied from its spec (drift repair: a
    deleted or hand-edited child returns within this period).
    ``runtime_image``: the default image of every cluster's pods (the chart's ``runtimeImage``),
    field by field under the cluster's own ``spec.image`` (:meth:`ImageSpec.under`); unset fields
    fall through to the release's image.
    """

    webhook_port: int | None = None
    webhook_cert_dir: str = ""
    webhook_insecure: bool = False
    metrics_port: int | None = None
    scrape_timeout_s: float = 2.0
    tick_s: float = 1.0
    namespace: str = ""
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    peering_lifetime_s: int | None = None
    resync_s: float = 30.0
    runtime_image: ImageSpec = field(default_factory=ImageSpec)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """Read ``COSINE_OPERATOR_*`` variables (the chart sets them); absent means default."""

        def opt_int(key: str) -> int | None:
            value = env.get(key, "")
            return int(value) if value else None

        return cls(
            webhook_port=opt_int("COSINE_OPERATOR_WEBHOOK_PORT"),
            webhook_cert_dir=env.get("COSINE_OPERATOR_WEBHOOK_CERT_DIR", ""),
            webhook_insecure=env.get("COSINE_OPERATOR_WEBHOOK_INSECURE", "") in ("1", "true"),
            metrics_port=opt_int("COSINE_OPERATOR_METRICS_PORT"),
            scrape_timeout_s=float(env.get("COSINE_OPERATOR_SCRAPE_TIMEOUT_S", cls.scrape_timeout_s)),
            peering_lifetime_s=opt_int("COSINE_OPERATOR_PEERING_LIFETIME_S"),
            resync_s=float(env.get("COSINE_OPERATOR_RESYNC_S", cls.resync_s)),
            namespace=env.get("COSINE_OPERATOR_NAMESPACE", ""),
            runtime_image=ImageSpec(
                repository=env.get("COSINE_OPERATOR_RUNTIME_IMAGE_REPOSITORY") or None,
                tag=env.get("COSINE_OPERATOR_RUNTIME_IMAGE_TAG") or None,
                pull_policy=env.get("COSINE_OPERATOR_RUNTIME_IMAGE_PULL_POLICY") or None,
            ),
            pod_labels={
                k.strip(): v.strip()
                for k, _, v in (item.partition("=") for item in env.get("COSINE_OPERATOR_POD_LABELS", "").split(","))
                if _
            },
        )
