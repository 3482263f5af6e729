"""What the operator tests did with ``kubectl``, as the API calls kubectl makes, with httpx.

``make install`` installs no kubectl (no registry we install from ships a current one), and these
tests must pass on a fresh machine. Each helper is the request kubectl sends for its command:
``apply --server-side`` is a server-side apply PATCH under kubectl's field manager, ``wait
--for condition=Established`` polls the CRD's status, ``scale`` is a merge patch of the object's
``/scale`` subresource, ``get`` of the printer columns is the server's ``Table``. Paths go
through the router (``api_router.py``), as a kubeconfig of its URL would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

FIELD_MANAGER = "kubectl"  # `kubectl apply --server-side`'s default field manager
NS = "default"  # the router kubeconfig's namespace
APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}
# what `kubectl get` asks for: the server renders the CRD's additionalPrinterColumns
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io, application/json"}


def client(router: Any) -> httpx.Client:
    return httpx.Client(base_url=router.url, timeout=30)


def resource_path(router: Any, api_version: str, kind: str, namespace: str = NS, timeout_s: float = 10) -> str:
    """The collection path of ``kind`` from the server's discovery (as kubectl's REST mapper finds
    it); waited for, as a CRD's resource is served a moment after it is Established."""
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    deadline = time.monotonic() + timeout_s
    with client(router) as http:
        while True:
            found = http.get(base)
            if found.status_code == 200:
                for r in found.json()["resources"]:
                    if r["kind"] == kind and "/" not in r["name"]:
                        scope = f"/namespaces/{namespace}" if r["namespaced"] else ""
                        return f"{base}{scope}/{r['name']}"
            if time.monotonic() > deadline:
                raise AssertionError(f"no {kind} in {base}: {found.status_code} {found.text[:500]}")
            time.sleep(0.2)


def apply(router: Any, *docs: dict[str, Any], validation: str = "Strict", check: bool = True) -> list[httpx.Response]:
    """``kubectl apply --server-side`` of ``docs`` (``validation="Ignore"``: ``--validate=false``)."""
    out = []
    with client(router) as http:
        for doc in docs:
            meta = doc["metadata"]
            path = resource_path(router, doc["apiVersion"], doc["kind"], meta.get("namespace", NS))
            r = http.patch(f"{path}/{meta['name']}", content=json.dumps(doc), headers=APPLY,
                           params={"fieldManager": FIELD_MANAGER, "fieldValidation": validation})
            if check and r.status_code not in (200, 201):
                raise AssertionError(f"apply {doc['kind']}/{meta['name']}: {r.status_code} {r.text[:2000]}")
            out.append(r)
    return out


def apply_files(router: Any, *paths: Path) -> None:
    """``kubectl apply --server-side -f PATH ...``: each file, or each ``*.yaml`` file of a folder."""
    files = [f for p in paths for f in (sorted(p.glob("*.yaml")) if p.is_dir() else [p])]
    apply(router, *[d for f in files for d in yaml.safe_load_all(f.read_text()) if d])


def wait_established(router: Any, *crds: str, timeout_s: float = 30) -> None:
    """``kubectl wait --for condition=Established crd/NAME ...``."""
    deadline = time.monotonic() + timeout_s
    with client(router) as http:
        for name in crds:
            while True:
                r = http.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                conditions = (r.json().get("status") or {}).get("conditions") or [] if r.status_code == 200 else []
                if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"crd/{name} not Established in {timeout_s} s: {r.text[:2000]}")
                time.sleep(0.2)


def get(router: Any, path: str) -> dict[str, Any] | None:
    """``kubectl get ... -o json`` of one object (None: not found)."""
    with client(router) as http:
        r = http.get(path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return dict(r.json())


def table(router: Any, path: str) -> tuple[list[str], list[list[Any]]]:
    """What ``kubectl get`` prints for one object: the column names and the rows' cells."""
    with client(router) as http:
        r = http.get(path, headers=TABLE)
    r.raise_for_status()
    out = r.json()
    assert out["kind"] == "Table", out
    return [c["name"] for c in out["columnDefinitions"]], [row["cells"] for row in out["rows"]]


def patch(router: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``kubectl patch --type merge -p BODY``."""
    with client(router) as http:
        r = http.patch(path, content=json.dumps(body), headers=MERGE)
    if r.status_code != 200:
        raise AssertionError(f"patch {path}: {r.status_code} {r.text[:2000]}")
    return dict(r.json())


def scale(router: Any, path: str, replicas: int) -> httpx.Response:
    """``kubectl scale --replicas=N``: a merge patch of the object's scale subresource."""
    with client(router) as http:
        return http.patch(f"{path}/scale", content=json.dumps({"spec": {"replicas": replicas}}), headers=MERGE)


def delete(router: Any, path: str) -> None:
    """``kubectl delete --wait=false`` (a missing object is no error here)."""
    with client(router) as http:
        r = http.delete(path)
    if r.status_code not in (200, 202, 404):
        raise AssertionError(f"delete {path}: {r.status_code} {r.text[:2000]}")
