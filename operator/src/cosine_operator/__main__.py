"""``cosine-operator``: ``kopf run`` on :mod:`cosine_operator.handlers`, accepting kopf's flags.

    cosine-operator --standalone -A --verbose
    cosine-operator --namespace team-a --liveness=http://0.0.0.0:8080/healthz --log-format=json

Every argument is passed to ``kopf run`` unchanged (``--standalone``, ``-A``/``--all-namespaces``,
``-n``/``--namespace``, ``--verbose``, ``--debug``, ``--liveness``, ``--log-format``, ``--peering``);
the handlers' module is added, and the admission webhook's module (:mod:`cosine_operator.webhook`)
when ``COSINE_OPERATOR_WEBHOOK_PORT`` is set (kopf refuses admission handlers without a server).
Credentials: the pod's service account in a cluster, else
``KUBECONFIG`` (the ``operator_login`` handler). Operator settings: ``COSINE_OPERATOR_*`` variables
(:class:`cosine_operator.settings.OperatorConfig`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from cosine_operator.settings import OperatorConfig

HANDLERS_MODULE = "cosine_operator.handlers"
WEBHOOK_MODULE = "cosine_operator.webhook"


def kopf_args(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The ``kopf`` command line for our arguments: ``run -m cosine_operator.handlers [-m …webhook] ARGS``."""
    args = list(argv)
    if args and args[0] == "run":  # tolerate `cosine-operator run ...`
        args = args[1:]
    modules = ["-m", HANDLERS_MODULE]
    if OperatorConfig.from_env(env).webhook_port is not None:
        modules += ["-m", WEBHOOK_MODULE]
    return ["run", *modules, *args]


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point; exits with kopf's exit code."""
    from kopf.cli import main as kopf_main

    args = kopf_args(sys.argv[1:] if argv is None else argv, os.environ)
    kopf_main(args=args, prog_name="cosine-operator")


if __name__ == "__main__":
    main()
