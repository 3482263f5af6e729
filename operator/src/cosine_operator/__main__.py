"""``cosine-operator``: ``kopf run`` on :mod:`cosine_operator.handlers`, accepting kopf's flags.

    cosine-operator --standalone -A --verbose
    cosine-operator --namespace team-a --liveness=http://0.0.0.0:8080/healthz --log-format=json

Every argument is passed to ``kopf run`` unchanged (``--standalone``, ``-A``/``--all-namespaces``,
``-n``/``--namespace``, ``--verbose``, ``--debug``, ``--liveness``, ``--log-format``, ``--peering``);
the handlers' module is added, and the admission webhook's module (:mod:`cosine_operator.webhook`)
when ``COSINE_OPERATOR_WEBHOOK_PORT`` is set (kopf refuses admission handlers without a server).
With ``--peering`` and no ``--priority``, the replica's priority comes from its pod's name
(``POD_ID``, kopf's own variable for its peer identity; the chart sets it from the downward API):
kopf pauses every replica that sees a live peer of higher *or equal* priority
(``kopf/_core/engines/peering.py``), so equal priorities, kopf's default, would pause them all.
Distinct priorities leave exactly one replica acting: the one whose name hashes highest.
Credentials: the pod's service account in a cluster, else
``KUBECONFIG`` (the ``operator_login`` handler). Operator settings: ``COSINE_OPERATOR_*`` variables
(:class:`cosine_operator.config.OperatorConfig`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping, Sequence

from cosine_operator.config import OperatorConfig

HANDLERS_MODULE = "cosine_operator.handlers"
WEBHOOK_MODULE = "cosine_operator.webhook"


def peering_priority(pod_name: str) -> int:
    """A replica's kopf peering priority, in ``[1, 2**28]``, from its pod's name: stable for a
    pod's life, distinct between pods but for a 1-in-2**28 chance per pair."""
    return int(hashlib.sha256(pod_name.encode()).hexdigest()[:7], 16) + 1


def _has_option(args: Sequence[str], *names: str) -> bool:
    return any(a in names or a.startswith(tuple(f"{n}=" for n in names if n.startswith("--"))) for a in args)


def kopf_args(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The ``kopf`` command line for our arguments: ``run -m cosine_operator.handlers [-m …webhook] ARGS``,
    plus ``--priority`` from ``POD_ID`` (:func:`peering_priority`) under ``--peering`` when none is given."""
    args = list(argv)
    if args and args[0] == "run":  # tolerate `cosine-operator run ...`
        args = args[1:]
    modules = ["-m", HANDLERS_MODULE]
    if OperatorConfig.from_env(env).webhook_port is not None:
        modules += ["-m", WEBHOOK_MODULE]
    pod = env.get("POD_ID", "")
    if pod and _has_option(args, "--peering", "-P") and not _has_option(args, "--priority", "-p", "--dev"):
        args.append(f"--priority={peering_priority(pod)}")
    return ["run", *modules, *args]


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point; exits with kopf's exit code."""
    from kopf.cli import main as kopf_main

    args = kopf_args(sys.argv[1:] if argv is None else argv, os.environ)
    kopf_main(args=args, prog_name="cosine-operator")


if __name__ == "__main__":
    main()
