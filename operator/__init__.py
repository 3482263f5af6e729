"""CoSine's control plane: the ``CoSineCluster`` operator (kopf), importable as ``cosine.operator``.

Modules, one concept each: ``settings`` (typed spec), ``builders`` (pure manifests),
``autoscaling`` (pure scaling policy), ``metrics_scrape`` (Prometheus text → observations),
``handlers`` (thin kopf handlers), ``webhook`` (admission checks CEL cannot express),
``__main__`` (the ``cosine-operator`` console script).
"""

# This folder is mapped onto ``cosine.operator`` (pyproject ``package-dir``). When the repository
# root is on ``sys.path`` (``python -m pytest`` and ``python -c`` from the root put it first), the
# name ``operator`` would resolve to this folder instead of the standard library's module, and
# ``enum``/``collections`` would fail to import. Imported under that name, we therefore become the
# standard library's ``operator`` (``os`` is always loaded at start-up, so its folder is the stdlib).
if __name__ == "operator":  # pragma: no cover - exercised by every `python -m` run from the root
    import sys as _sys

    _stdlib_operator = str(_sys.modules["os"].__file__).rsplit("/", 1)[0] + "/operator.py"
    with open(_stdlib_operator, encoding="utf-8") as _source:
        exec(compile(_source.read(), _stdlib_operator, "exec"), globals())  # noqa: S102
    del _sys, _source, _stdlib_operator
