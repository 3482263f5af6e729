"""Pure builders of a ``CoSineCluster``'s children: plain manifest dicts, no API calls, one module
per family of children, and the inventory of them all (:mod:`.inventory`).

For a cluster ``N`` in namespace ``NS`` (the runtime contract):

* ConfigMap ``N-config``, key ``cluster.yaml``: the CoSineCluster (apiVersion, kind, metadata.name,
  spec) the runtime reads from ``/etc/cosine/cluster.yaml``;
* Deployment + Service ``N-verifier`` (http 8000: vLLM's OpenAI server, /health, /metrics; metrics 9091:
  CoSine's series) and the gateway Service ``N-gateway`` (``spec.gateway.serviceType``, ``port`` → 8000);
* per drafter pool ``P``: Deployment ``N-drafter-P``, headless Service ``N-drafter-P`` (grpc 50052,
  metrics 9090) and the scale target ``CoSineDrafterPool`` ``N-P``. The pool's ``spec.replicas``
  (its ``scale`` subresource: the operator's autoscaler, HPA/KEDA or ``kubectl scale`` write it) is
  the one value the Deployment's replicas follow. Every builder gives ``replicas`` for creation
  only: the operator applies an existing Deployment or pool without them
  (``kube.apply_scale_free``), so it never changes a scale after creation.
* NetworkPolicies (``spec.networkPolicy.enabled``): ``N-verifier`` (http from anywhere, metrics from
  the metrics sources) and per pool ``N-drafter-P`` (gRPC from the cluster's verifier pods only,
  metrics from the metrics sources): :func:`build_network_policies`;
* with ``spec.drafterTLS``, its Secret mounted read-only at ``TLS_DIR`` in drafter and verifier pods.

The families: :mod:`.workloads` (the ConfigMap, the verifier's and pools' Deployments, the
fallbacks, the disruption budgets, the scale targets), :mod:`.multinode` (a verifier replica over
several nodes: a LeaderWorkerSet), :mod:`.storage` (the model cache's claim and pull Job),
:mod:`.networking` (Services and NetworkPolicies), :mod:`.router` (``spec.router``'s objects);
beneath them :mod:`.names` (children's names, labels and selectors), :mod:`.pods` (pod specs,
templates and Deployments) and :mod:`.security` (what Pod Security ``restricted`` asks);
:mod:`.inventory` says which children a spec implies and which owned ones are left over.

Every builder takes the spec parsed once (:class:`~cosine_spec.cluster_spec.ClusterSpec`).
Owner references are not set here; the handlers ``kopf.adopt()`` every child.
"""
