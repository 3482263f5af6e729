"""A stateful Kubernetes API for tests: ``kmock`` 0.8 plus a thin realism layer.

kmock stores objects, merges/JSON-patches them and streams watch events. This layer adds what
kopf and our operator rely on: ``uid``/``resourceVersion``/``generation``/``creationTimestamp``,
resourceVersion bumped on every write, 422 on a failed JSON-patch ``test``, 409 on a stale
resourceVersion in a merge patch, ``status`` subresource semantics, ``kind`` in lists, equality
label selectors, cascading deletion through ``ownerReferences`` (the garbage collector), and
server-side apply with field ownership, as the real server's field manager keeps it (Kubernetes'
"Server-Side Apply" docs, "Field Management" and "Merge strategy"; structured-merge-diff): each
write records which manager (``fieldManager``, ``Apply`` or ``Update``) owns which leaf fields
(lists are atomic here, as ``x-kubernetes-list-type: atomic``); an apply creates a missing object,
and on an existing one removes the fields its manager applied last time, leaves out now, and no
other manager owns; an ``Update`` (create, merge or JSON patch, ``/scale``) that changes a field
takes it from every other owner; a forced apply takes the fields whose values it changes, and
shares those it sets to the value they have. ``metadata.managedFields`` shows it in ``FieldsV1``.
No built-in controllers: tests play the Deployment controller by patching ``status``.

:class:`EmulatorThread` runs it on loopback in a thread of its own (the operator runs in
another, via ``kopf.testing.KopfRunner``) and writes a kubeconfig pointing at it.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kmock
import yaml
from kmock._internal import enums, rendering

CLUSTERS = "cosine.dev/v1alpha1/cosineclusters"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
JOBS = "batch/v1/jobs"
PVCS = "v1/persistentvolumeclaims"
PDBS = "policy/v1/poddisruptionbudgets"
EVENTS = "v1/events"
SERVICEACCOUNTS = "v1/serviceaccounts"
ROLES = "rbac.authorization.k8s.io/v1/roles"
ROLEBINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"

# group/version/plural -> (kind, subresources)
RESOURCES: dict[str, tuple[str, set[str]]] = {
    "cosine.dev/v1alpha1/cosineclusters": ("CoSineCluster", {"status"}),
    "cosine.dev/v1alpha1/cosinedrafterpools": ("CoSineDrafterPool", {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", {"status", "scale"}),
    "v1/pods": ("Pod", {"status"}),
    "v1/services": ("Service", {"status"}),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", {"status"}),
    "batch/v1/jobs": ("Job", {"status"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", {"status"}),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", set()),
    "v1/events": ("Event", set()),
    "v1/serviceaccounts": ("ServiceAccount", set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", set()),
}
# Cluster-scoped resources kopf's "backbone" waits for in discovery (it watches CRDs; with -A it
# never lists namespaces, which kmock 0.8 serves wrongly).
CLUSTER_RESOURCES: dict[str, str] = {
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}


class RealisticEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock's emulator with server-side metadata, conflicts, subresources and GC.

    ``patches`` records every PATCH as the client sent it: ``(resource, name, subresource, body)``
    with ``resource`` as in :data:`RESOURCES` (tests assert on who writes what).
    """

    _counter = itertools.count(1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.patches: list[tuple[str, str | None, str | None, Any]] = []
        # (resource, namespace, name) -> (manager, operation) -> the leaf paths it owns
        self._owners: dict[tuple[str, str | None, str], dict[tuple[str, str], set[tuple[str, ...]]]] = {}
        # A slow API server, for tests: (resource, name) -> seconds each write to it waits before
        # it is served; `slowed` counts the writes that waited.
        self.slow_writes: dict[tuple[str, str], float] = {}
        self.slowed = 0

    def _server_side_apply(self, request: rendering.Request) -> None:
        """Rewrite an apply patch, in place (kmock follows the request object), into the create or
        merge patch that has its effect (see the module docstring)."""
        manager = request.params.get("fieldManager")
        if not manager:
            raise kmock.KubernetesError(status=422, reason="Invalid", message="fieldManager is required for apply")
        applied = copy.deepcopy(request.data)
        found = self._find(request)
        if found is None or found[1].deleted:
            applied.setdefault("metadata", {}).setdefault("namespace", request.namespace)
            changes = {"method": enums.method.POST, "action": enums.action.CREATE, "name": None,
                       "data": copy.deepcopy(applied)}
        else:
            current = copy.deepcopy(found[1].raw)
            owners = self._owners.get(self._object_key(request, current), {})
            mine = owners.get((manager, "Apply"), set())
            others = set().union(*(paths for who, paths in owners.items() if who != (manager, "Apply")))
            dropped = mine - set(_leaves(applied)) - others
            if str(request.params.get("force", "")).lower() != "true":  # an unforced apply may not take a field
                live = _leaves(current)
                conflicts = sorted(".".join(p) for p, v in _leaves(applied).items()
                                   if p in others and live.get(p, _ABSENT) != v)
                if conflicts:
                    raise kmock.KubernetesError(status=409, reason="Conflict",
                                                message=f"Apply failed with conflicts: {', '.join(conflicts)}")
            changes = {"data": _merge_patch(current, _merge(_drop(current, dropped), applied, replace_lists=True))}
        for field, value in changes.items():
            object.__setattr__(request, field, value)  # attrs-frozen

    @staticmethod
    def _object_key(request: rendering.Request, body: dict[str, Any]) -> tuple[str, str | None, str]:
        meta = body.get("metadata") or {}
        return RealisticEmulator._key(request), request.namespace or meta.get("namespace"), request.name or meta["name"]

    def _stamp_owners(self, request: rendering.Request, before: dict[str, Any] | None,
                      apply: dict[str, Any] | None, manager: str) -> None:
        """Move field ownership for the write about to be stored (see the module docstring) and
        write it into the request as ``metadata.managedFields``, so the stored object and the
        response both carry it, as the real server's do."""
        data = request.data
        if isinstance(data, list):  # JSON patch
            after = jsonpatch.apply_patch(before or {}, data)
        elif before is None:  # a create
            after = copy.deepcopy(data)
        else:
            after = _merge(before, data)
        try:
            key = self._object_key(request, after)
        except KeyError:
            return
        if before is None:  # a new object: no owners yet (a deleted one's are gone with it)
            self._owners[key] = {}
        owners = self._owners.setdefault(key, {})
        old, new = _leaves(before), _leaves(after)
        changed = {p for p in set(old) | set(new) if old.get(p, _ABSENT) != new.get(p, _ABSENT)}
        if apply is not None:
            who, mine = (manager, "Apply"), set(_leaves(apply))
            for other, paths in owners.items():
                if other != who:
                    paths -= changed & mine
            owners[who] = mine
        else:
            who = (manager, "Update")
            for other, paths in owners.items():
                if other != who:
                    paths -= changed
            owners[who] = (owners.get(who, set()) | changed) & set(new)
        fields = [{"manager": m, "operation": op, "apiVersion": after.get("apiVersion"), "fieldsType": "FieldsV1",
                   "fieldsV1": _fields_v1(paths)} for (m, op), paths in owners.items() if paths]
        if isinstance(data, list):
            data.append({"op": "add", "path": "/metadata/managedFields", "value": fields})
        else:
            data.setdefault("metadata", {})["managedFields"] = fields

    def _find_named(self, request: rendering.Request, namespace: str | None, name: str) -> Any:
        for (resource, ns, n), obj in self.objects.items():
            if resource == request.resource and ns == namespace and n == name:
                return obj
        return None

    def _find(self, request: rendering.Request) -> tuple[Any, Any] | None:
        for key, obj in self.objects.items():
            resource, namespace, name = key
            if resource == request.resource and namespace == request.namespace and name == request.name:
                return key, obj
        return None

    async def _handle(self, request: rendering.Request) -> Any:
        # kmock matches each request against its recorded history (for its assertion DSL), which
        # makes a request cost O(requests so far); we assert on objects, so keep only this one.
        del self._requests[:-1]
        if request.resource is None:
            return await super()._handle(request)
        writes = request.action in (enums.action.CREATE, enums.action.UPDATE)
        delay = self.slow_writes.get((self._key(request), request.name or "")) if writes else None
        if delay:
            self.slowed += 1
            await asyncio.sleep(delay)
        manager = request.params.get("fieldManager") or "unknown"
        found = self._find(request) if request.name is not None else None
        before = copy.deepcopy(found[1].raw) if found is not None and not found[1].deleted else None
        content_type = request.headers.get("Content-Type", "")
        apply = None
        if request.action == enums.action.UPDATE and content_type.startswith("application/apply-patch"):
            apply = copy.deepcopy(request.data)
            self._server_side_apply(request)
        return await self._write(request, before, apply, manager if writes else None)

    async def _write(self, request: rendering.Request, before: dict[str, Any] | None, apply: dict[str, Any] | None,
                     manager: str | None) -> Any:
        rv = str(next(self._counter))
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            meta.update(
                uid=str(uuid.uuid4()),
                resourceVersion=rv,
                generation=1,
                creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            if request.data.get("kind") == "Deployment":
                request.data.setdefault("status", {})
                _default_strategy(request.data)
            if manager is not None:
                self._stamp_owners(request, None, apply, manager)
        elif request.action in (enums.action.UPDATE, enums.action.DELETE) and request.name is not None:
            found = self._find(request)
            if found is None or found[1].deleted:
                raise kmock.KubernetesNotFoundError()
            uid = found[1].raw["metadata"].get("uid")
            if request.action == enums.action.UPDATE:
                self.patches.append(
                    (self._key(request), request.name, request.subresource, copy.deepcopy(request.data))
                )
                self._rewrite_patch(request, copy.deepcopy(found[1].raw), rv)
                if manager is not None:
                    self._stamp_owners(request, copy.deepcopy(found[1].raw), apply, manager)
            response = await super()._handle(request)
            if found[1].deleted and uid:  # gone now (no finalizers left): collect its dependents
                await self._collect_garbage(uid)
            return response
        return await super()._handle(request)

    def _rewrite_patch(self, request: rendering.Request, current: dict[str, Any], rv: str) -> None:
        data = request.data
        if isinstance(data, list):  # JSON patch: the `test` ops must hold, as on a real server
            try:
                patched = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as e:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
            if request.subresource is None:
                _check_immutable(self._key(request), request.name, current, patched)
            if request.subresource is None and any(op.get("path", "").startswith("/spec") for op in data):
                data.append(
                    {
                        "op": "replace",
                        "path": "/metadata/generation",
                        "value": current["metadata"].get("generation", 1) + 1,
                    }
                )
            data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
            return
        if not isinstance(data, dict):
            return
        data = copy.deepcopy(data)  # rebuilt below, then written back into the request
        if request.subresource is None:
            if self._key(request) == DEPLOYMENTS:
                _default_strategy(data, _merge(current, data))
            _check_immutable(self._key(request), request.name, current, _merge(current, data))
        wanted_rv = (data.get("metadata") or {}).get("resourceVersion")
        if wanted_rv is not None and wanted_rv != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        subresources = RESOURCES.get(self._key(request), ("", set()))[1]
        if request.subresource == "status":
            data = {"status": data.get("status")}
        elif request.subresource == "scale":
            data = {"spec": {"replicas": (data.get("spec") or {}).get("replicas")}}
        elif "status" in subresources:
            data = {k: v for k, v in data.items() if k != "status"}
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = rv
        if "spec" in data:
            merged = _merge(current, data)
            if merged.get("spec") != current.get("spec"):
                meta["generation"] = current["metadata"].get("generation", 1) + 1
        request.data.clear()
        request.data.update(data)

    @staticmethod
    def _key(request: rendering.Request) -> str:
        r = request.resource
        return f"{r.group}/{r.version}/{r.plural}" if r.group else f"{r.version}/{r.plural}"

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete every object owned by ``owner_uid``, recursively (background propagation)."""
        async with self._lock:
            doomed = []
            for key, obj in self.objects.items():
                if obj.deleted:
                    continue
                refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    doomed.append((key, obj))
            uids = []
            for key, obj in doomed:
                raw = obj.raw
                obj.delete()
                uids.append(raw["metadata"].get("uid"))
                await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        for uid in uids:
            await self._collect_garbage(uid)

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        items = result["items"]
        if selector:
            pairs = [term.split("=", 1) for term in selector.split(",") if "=" in term]
            items = [
                i
                for i in items
                if all((i.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in pairs)
            ]
        kind = RESOURCES.get(self._key(request), ("Object", set()))[0]
        return {
            "apiVersion": "v1",
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": "1"},
            "items": items,
        }


def _get(obj: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        obj = (obj or {}).get(key) if isinstance(obj, dict) else None
    return obj


def _storage_bytes(quantity: Any) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    text = str(quantity or 0)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _pvc_change(current: dict[str, Any], updated: dict[str, Any]) -> str | None:
    """A PVC's spec is immutable but for growing ``resources.requests.storage`` (and
    ``volumeAttributesClassName``): Kubernetes' ``ValidatePersistentVolumeClaimUpdate``
    (pkg/apis/core/validation), documented at
    https://kubernetes.io/docs/concepts/storage/persistent-volumes/#expanding-persistent-volumes-claims."""
    old, new = copy.deepcopy(current.get("spec") or {}), copy.deepcopy(updated.get("spec") or {})
    old_storage = old.get("resources", {}).get("requests", {}).pop("storage", None)
    new_storage = new.get("resources", {}).get("requests", {}).pop("storage", None)
    for spec in (old, new):
        spec.pop("volumeAttributesClassName", None)
    if old != new:
        return "spec: Forbidden: spec is immutable after creation except resources.requests and " \
               "volumeAttributesClassName for bound claims"
    if _storage_bytes(new_storage) < _storage_bytes(old_storage):
        return "spec.resources.requests.storage: Forbidden: field can not be less than previous value"
    return None


def _default_strategy(data: dict[str, Any], merged: dict[str, Any] | None = None) -> None:
    """The Deployment defaults the real server writes into ``data`` (a new object, or an update
    whose result is ``merged``): strategy type ``RollingUpdate`` and, for that type, 25% surge and
    unavailability (``SetDefaults_Deployment``, pkg/apis/apps/v1/defaults.go). Being defaults, no
    manager owns them: an apply never removes them."""
    strategy = ((merged or data).get("spec") or {}).get("strategy") or {}
    if strategy.get("type", "RollingUpdate") == "RollingUpdate" and not strategy.get("rollingUpdate"):
        into = data.setdefault("spec", {}).setdefault("strategy", {})
        into.setdefault("type", "RollingUpdate")
        into["rollingUpdate"] = {"maxSurge": "25%", "maxUnavailable": "25%"}


def _deployment_change(current: dict[str, Any], updated: dict[str, Any]) -> str | None:
    """A Deployment's fixed selector, and ``ValidateDeploymentStrategy`` (pkg/apis/apps/validation):
    a ``Recreate`` strategy with a ``rollingUpdate`` is refused ("may not be specified when
    strategy `type` is 'Recreate'"), as after an apply that only changes the type (kubernetes#24198)."""
    strategy = (updated.get("spec") or {}).get("strategy") or {}
    if strategy.get("type") == "Recreate" and strategy.get("rollingUpdate") is not None:
        return "spec.strategy.rollingUpdate: Forbidden: may not be specified when strategy `type` is 'Recreate'"
    return _fields_fixed("spec.selector")(current, updated)


def _fields_fixed(*paths: str) -> Callable[[dict[str, Any], dict[str, Any]], str | None]:
    def check(current: dict[str, Any], updated: dict[str, Any]) -> str | None:
        for path in paths:
            before, after = _get(current, path), _get(updated, path)
            if before is not None and after != before:
                return f"{path}: Invalid value: {json.dumps(after)}: field is immutable"
        return None
    return check


# What the real API server refuses to change on an update (HTTP 422), per kind we create, each with
# its source. The emulator knows only these; anything else changes freely here.
IMMUTABLE: dict[str, Callable[[dict[str, Any], dict[str, Any]], str | None]] = {
    # ValidateJobSpecUpdate (pkg/apis/batch/validation): selector and pod template are fixed once the
    # Job exists (https://kubernetes.io/docs/concepts/workloads/controllers/job/: "a Job's
    # .spec.template ... immutable"; the API reference's JobSpec.template).
    JOBS: _fields_fixed("spec.selector", "spec.template"),
    # apps/v1: "a Deployment's label selector is immutable after it gets created"
    # (https://kubernetes.io/docs/concepts/workloads/controllers/deployment/#label-selector-updates),
    # and its strategy's validation (_deployment_change).
    DEPLOYMENTS: _deployment_change,
    # ServiceSpec.clusterIP: "may not be changed through updates unless the type field is also being
    # changed to ExternalName" (API reference, Service v1; ValidateServiceUpdate).
    SERVICES: _fields_fixed("spec.clusterIP"),
    PVCS: _pvc_change,
    # ValidateRoleBindingUpdate (pkg/apis/rbac/validation): "cannot change roleRef"; the RBAC docs
    # ("After you create a binding, you cannot change the Role or ClusterRole that it refers to").
    ROLEBINDINGS: _fields_fixed("roleRef"),
}


def _check_immutable(resource: str, name: str | None, current: dict[str, Any], updated: dict[str, Any]) -> None:
    """Raise the real server's 422 if ``updated`` changes what :data:`IMMUTABLE` fixes for ``resource``."""
    rule = IMMUTABLE.get(resource)
    problem = rule(current, updated) if rule else None
    if problem is not None:
        kind = RESOURCES[resource][0]
        raise kmock.KubernetesError(status=422, reason="Invalid", message=f'{kind} "{name}" is invalid: {problem}')


def _merge(base: dict[str, Any], patch: dict[str, Any], replace_lists: bool = False) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, replace_lists)
        else:
            out[key] = copy.deepcopy(value)
    return out


_ABSENT = object()
# Set by the server, never owned by a manager (the real server tracks none of these in managedFields).
_SERVER_FIELDS = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace"),
                  ("metadata", "uid"), ("metadata", "resourceVersion"), ("metadata", "generation"),
                  ("metadata", "creationTimestamp"), ("metadata", "managedFields")}


def _leaves(obj: dict[str, Any] | None, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf field of ``obj`` by path: a non-empty map is descended into, anything else (a
    scalar, a list: atomic here, an empty map) is a leaf."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in (obj or {}).items():
        path = (*prefix, key)
        if path in _SERVER_FIELDS:
            continue
        if isinstance(value, dict) and value:
            out.update(_leaves(value, path))
        else:
            out[path] = value
    return out


def _drop(obj: dict[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """``obj`` without the leaves at ``paths``, and without maps those removals left empty."""
    out = copy.deepcopy(obj)
    for path in paths:
        parents = [out]
        for key in path[:-1]:
            child = parents[-1].get(key)
            if not isinstance(child, dict):
                break
            parents.append(child)
        else:
            parents[-1].pop(path[-1], None)
            for depth in range(len(parents) - 1, 0, -1):
                if not parents[depth]:
                    parents[depth - 1].pop(path[depth - 1], None)
    return out


def _fields_v1(paths: set[tuple[str, ...]]) -> dict[str, Any]:
    """Leaf paths as the server's ``FieldsV1`` tree: ``{"f:spec": {"f:replicas": {}}}``."""
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _merge_patch(current: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``current`` into ``target``."""
    patch: dict[str, Any] = {key: None for key in current if key not in target}
    for key, value in target.items():
        old = current.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            inner = _merge_patch(old, value)
            if inner:
                patch[key] = inner
        elif value != old:
            patch[key] = copy.deepcopy(value)
    return patch


class EmulatorThread:
    """The emulator on 127.0.0.1 in a background thread; ``kubeconfig`` points at it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.kubeconfig = workdir / "kubeconfig"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.emulator: RealisticEmulator | None = None
        self.url = ""

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with RealisticEmulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            for key, (kind, subresources) in RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(
                    namespaced=True,
                    kind=kind,
                    subresources=subresources,
                    verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                )
            for key, kind in CLUSTER_RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(
                    namespaced=False,
                    kind=kind,
                    verbs={"get", "list", "watch"},
                )
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        self._future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        if not self._ready.wait(10):
            raise RuntimeError(f"emulator did not start: {self._future.exception(timeout=1)!r}")
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [
                        {
                            "name": "emulator",
                            "context": {"cluster": "emulator", "user": "tester", "namespace": "default"},
                        }
                    ],
                }
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._future.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class Kube:
    """A small synchronous client for tests: paths in, dicts out."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    @staticmethod
    def path(resource: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        group_version, plural = resource.rsplit("/", 1)
        prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        out = f"{prefix}/namespaces/{namespace}/{plural}"
        return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        r = self.http.get(self.path(resource, namespace, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return dict(r.json())

    def list(self, resource: str, namespace: str) -> list[dict[str, Any]]:
        r = self.http.get(self.path(resource, namespace))
        r.raise_for_status()
        return list(r.json()["items"])

    def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(self.path(resource, namespace), json=body)
        r.raise_for_status()
        return dict(r.json())

    def patch(
        self, resource: str, namespace: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        r = self.http.patch(
            self.path(resource, namespace, name, sub),
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()
        return dict(r.json())

    def delete(self, resource: str, namespace: str, name: str, missing_ok: bool = False) -> None:
        """Delete the object; `missing_ok`: one already gone (404) is not an error."""
        r = self.http.delete(self.path(resource, namespace, name))
        if not (missing_ok and r.status_code == 404):
            r.raise_for_status()


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 50 ms until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError):
            last = None
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
