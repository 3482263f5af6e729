"""CoSine's API, which the operator (``cosine_operator``) and the runtime (``cosine``) both stand on.

Modules, one concept each: ``settings`` (the ``CoSineCluster`` types and their strict parser),
``metric_names`` (every series name: the contract between the runtime that exports them and
whoever reads them), ``autoscaling`` (the pure pool scaling rule), ``scaling_loop`` (observe,
decide, actuate, report: the one loop the operator, ``cosine serve`` and the simulator run) and
``metrics_scrape`` (Prometheus text → rates → observations, and fetching it). No kopf, no model
code (``.importlinter``).
"""
