"""``python -m cosine_operator.sample apply|delete``: the chart's sample CoSineCluster
(``values.sampleCluster``), written by a Helm hook Job once the operator's webhook answers.

Why a Job and not a release object: Helm 4 creates kinds it does not know (a CoSineCluster) after
the ValidatingWebhookConfiguration (``InstallOrder`` in ``kind_sorter.go``) and does not wait for
the operator in between. With ``failurePolicy: Fail`` the API server then refuses the object: it
cannot call the webhook ("no endpoints available"). Helm runs hooks after the release's objects,
one weight at a time, and waits for a hook Job to complete (``execHook``, ``WatchUntilReady``).
So the Job retries until the webhook admits the object (or refuses it, for a reason it states).

``apply``: server-side apply of ``$COSINE_SAMPLE`` (the CoSineCluster, JSON) as :data:`MANAGER`,
on ``post-install`` and ``post-upgrade``: a changed sample is updated in place, never recreated.
``delete``: on ``pre-delete``, while the operator still runs, delete it and wait until it is gone
(the operator's finalizer), so an uninstall leaves no cluster behind that nothing can finalize.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import ClientError
from kubernetes_asyncio.client.exceptions import ApiException

from cosine_operator import kube

MANAGER = "cosine-sample"  # the sample's field manager (server-side apply)
RETRY_S = 2.0
# Below Helm's default --timeout (5 min), so the Job says why before Helm gives up on it.
TIMEOUT_S = 240.0


def transient(status: int) -> bool:
    """Whether a refused call may succeed if tried again: the API server could not call the webhook
    yet (500: no endpoints, connection refused, a caBundle not yet injected), is not serving the API
    yet (404, 503), or the Job's RBAC has not reached it (403). A 400/409/422 is an answer: the
    webhook or the CRD's schema refused the spec."""
    return status >= 500 or status in (403, 404, 429)


async def retry(call: Callable[[], Awaitable[Any]], timeout_s: float, log: Callable[[str], None]) -> Any:
    """``call()`` every :data:`RETRY_S` until it succeeds, a non-:func:`transient` refusal
    (raised), or ``timeout_s`` (the last error raised)."""
    clock = time.monotonic
    deadline = clock() + timeout_s
    while True:
        try:
            return await call()
        except ApiException as e:
            if not transient(e.status) or clock() >= deadline:
                raise
            log(f"not yet ({e.status}): {kube.error_message(e)}")
        except (ClientError, OSError) as e:  # the API server itself not reachable yet
            if clock() >= deadline:
                raise
            log(f"not yet: {e!r}")
        await asyncio.sleep(RETRY_S)


async def apply(api: Any, body: Mapping[str, Any], timeout_s: float, log: Callable[[str], None]) -> None:
    """Apply the sample, retrying while the webhook cannot be called. A sample still being deleted
    (an upgrade from a chart whose sample was a release object: Helm deletes it, then runs the
    hooks) is waited out first: applied to, it would still go once its finalizer is removed."""
    meta = body["metadata"]
    await _gone(api, body, timeout_s, log, terminating_only=True)
    await retry(lambda: kube.apply(api, body, MANAGER), timeout_s, log)
    log(f"applied CoSineCluster {meta['namespace']}/{meta['name']}")


async def delete(api: Any, body: Mapping[str, Any], timeout_s: float, log: Callable[[str], None]) -> None:
    """Delete the sample and wait until it is gone. Raises ``TimeoutError`` if it is not."""
    meta = body["metadata"]
    await retry(lambda: kube.delete(api, body["kind"], meta["namespace"], meta["name"]), timeout_s, log)
    await _gone(api, body, timeout_s, log)
    log(f"deleted CoSineCluster {meta['namespace']}/{meta['name']}")


async def _gone(
    api: Any, body: Mapping[str, Any], timeout_s: float, log: Callable[[str], None], terminating_only: bool = False
) -> None:
    """Wait until the object does not exist (``terminating_only``: or exists and is not being
    deleted). Raises ``TimeoutError``."""
    kind, meta = body["kind"], body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    deadline = time.monotonic() + timeout_s
    while (live := await retry(lambda: kube.get(api, kind, namespace, name), timeout_s, log)) is not None:
        if terminating_only and not live["metadata"].get("deletionTimestamp"):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"CoSineCluster {namespace}/{name} still there after {timeout_s:.0f} s "
                "(is the operator running? it removes its finalizer)"
            )
        log(f"waiting for CoSineCluster {namespace}/{name} to be deleted")
        await asyncio.sleep(RETRY_S)


async def _main(action: str, env: Mapping[str, str]) -> None:
    body = json.loads(env["COSINE_SAMPLE"])
    timeout_s = float(env.get("COSINE_SAMPLE_TIMEOUT_S") or TIMEOUT_S)
    api = await kube.connect()
    try:
        await (apply if action == "apply" else delete)(api, body, timeout_s, lambda m: print(m, flush=True))
    finally:
        await api.close()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["apply"], ["delete"]):
        sys.exit("usage: python -m cosine_operator.sample apply|delete  (the object in $COSINE_SAMPLE)")
    asyncio.run(_main(args[0], os.environ))


if __name__ == "__main__":
    main()
