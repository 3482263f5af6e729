"""CoSine's control plane: the ``CoSineCluster`` operator (kopf), importable as ``cosine_operator``.

Modules, one concept each: ``settings`` (typed spec), ``builders`` (pure manifests),
``autoscaling`` (pure scaling policy), ``metrics_scrape`` (Prometheus text → observations),
``handlers`` (thin kopf handlers), ``webhook`` (admission checks CEL cannot express),
``__main__`` (the ``cosine-operator`` console script).

``settings`` and ``autoscaling`` (with ``builders`` and ``status``) import only the standard library
and PyYAML: they are the CRD's types and policies, which the runtime distribution (``cosine``) imports
too; the kopf modules stay here (``.importlinter``).
"""
