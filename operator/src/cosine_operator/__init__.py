"""CoSine's control plane: the ``CoSineCluster`` operator (kopf), importable as ``cosine_operator``.

Modules, one concept each: ``builders`` (pure manifests), ``status`` (pure status and conditions),
``handlers`` (thin kopf handlers), ``kube`` (every API call it makes), ``webhook`` (admission
checks CEL cannot express), ``telemetry`` (its own metrics), ``__main__`` (the ``cosine-operator``
console script). The spec types, metric names, scaling rule and loop are ``cosine_spec``'s, which
the runtime imports too; nothing of this package is imported by the runtime (``.importlinter``).
"""
