"""Facts the operator's children and the runtime's roles must agree on, written once: the API's
identity, the ports, the paths a pod is laid out with, the environment variables one side sets and
the other reads, and the labels. The operator's builders write them into manifests; the runtime's
roles and CLI read them back (STYLE.md #21's rule for contracts between processes).
"""

from __future__ import annotations

GROUP = "cosine.dev"
VERSION = "v1alpha1"
CLUSTER_PLURAL = "cosineclusters"
POOL_PLURAL = "cosinedrafterpools"
CLUSTER_KIND = "CoSineCluster"
POOL_KIND = "CoSineDrafterPool"

# Port numbers of the runtime (see its CLI).
VERIFIER_HTTP_PORT = 8000  # vLLM's OpenAI server: the API, /health and /metrics (vllm: series)
VERIFIER_METRICS_PORT = 9091  # CoSine's proposer in vLLM's engine core: cosine_ series (the autoscaler's)
DRAFTER_GRPC_PORT = 50052
DRAFTER_METRICS_PORT = 9090
EMBEDDED_METRICS_PORT = 9092  # `cosine serve`'s own series: its pools' replicas and price, autoscaling

GPU_RESOURCE = "nvidia.com/gpu"

# Paths in the pods. The cluster's ConfigMap (its spec) is mounted at CONFIG_DIR, read by every
# role from CONFIG_FILE; the model cache is at MODEL_CACHE_DIR ($COSINE_CACHE); spec.drafterTLS's
# Secret at TLS_DIR (not under CONFIG_DIR: a read-only volume of its own).
CONFIG_DIR = "/etc/cosine"
CONFIG_FILE = f"{CONFIG_DIR}/cluster.yaml"
MODEL_CACHE_DIR = "/models"
TLS_DIR = "/etc/cosine-tls"
# Where spec.modelCredentialsSecretRef's Secret is mounted in the containers that download models.
MODEL_CREDENTIALS_DIR = "/var/run/secrets/cosine/model-credentials"

# Environment variables. COSINE_CACHE: the model store's directory; COSINE_API_KEY: the key the
# verifier's OpenAI server requires (spec.gateway.apiKeySecretRef).
COSINE_CACHE_ENV = "COSINE_CACHE"
COSINE_API_KEY_ENV = "COSINE_API_KEY"
# LeaderWorkerSet's variables in every pod of a group (a multi-node verifier replica)
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"  # 0 on the leader, 1.. on the workers

# Labels on the children and their pods.
CLUSTER_LABEL = "cosine.dev/cluster"
POOL_LABEL = "cosine.dev/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
# A spot pool's pods: ``spot`` on the pool's own Deployment's, ``onDemand`` on its fallback sibling's
# (the operator's fallback Deployment), so each Deployment's pods can be told apart.
CAPACITY_LABEL = "cosine.dev/capacity"

# Prometheus labels for a series' CoSineCluster: `cosine_cluster` on every series (the chart's monitors
# copy it from a pod's CLUSTER_LABEL; the operator's per-cluster series carry it themselves), and
# `cosine_namespace` on the operator's per-cluster series (a scrape sets `namespace` to the pod's,
# the operator's own). Not `cluster` and `namespace`: GKE's Managed Prometheus refuses to write
# either from a pod label or a scraped series (`protectedLabel`, prometheus-engine's pod_config.go)
# and sets `cluster` to the Kubernetes cluster's name, as Thanos and Mimir setups do.
METRIC_CLUSTER_LABEL = "cosine_cluster"
METRIC_NAMESPACE_LABEL = "cosine_namespace"
