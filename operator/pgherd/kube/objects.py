"""The objects a PostgresCluster owns, kept as the builders describe them.

- Secrets are created once (a password, token or CA is read back, never regenerated); the only data
  ever replaced are the certificates of the agents' Secret when `secrets.agent_certificate_due` says
  so (the CA and the token's digest kept), and the app Secret of a cluster made before TLS, which gains
  the CA and a verify-full URI (its password kept). Nothing secret is logged.
- Other objects are created when missing and patched when their desired form changed since this
  operator last applied it (a memo of the desired body's digest: no request in the steady state).
- The StatefulSet's immutable fields are never patched: a change there is reported (an Event and the
  error returned) and the rest of the spec still applies. Its ``replicas`` belong to the engine's
  CreateMember/DeleteMember, never to this reconciliation.
- A PodDisruptionBudget exists only from two instances on (one instance: any budget blocks drains).
- The members' NetworkPolicy exists while `spec.networkPolicy.enabled`; it is applied before the
  StatefulSet, so that no member starts unprotected.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pgherd.api.annotations import rotate_request
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine.actions import Prune
from pgherd.kube import names
from pgherd.kube.api import ApiError, KubeApi
from pgherd.kube.builders import (
    common,
    configmap,
    jobs,
    networkpolicy,
    pdb,
    secrets,
    serviceaccount,
    services,
    statefulset,
)
from pgherd.kube.builders.statefulset import quantity

if TYPE_CHECKING:
    from pgherd.kube.loop import OperatorConfig

log = logging.getLogger("pgherd.kube.objects")
JSON = dict[str, Any]


# After a refused renewal, the next attempt waits this long (seconds): a refusal (RBAC, a webhook) is
# not retried at every tick, and the condition CertificatesValid says why meanwhile.
RENEW_RETRY = 30.0


@dataclass(frozen=True)
class AgentSecrets:
    token: str
    ca_pem: str
    server_hostname: Callable[[str], str | None]


@dataclass(frozen=True)
class CertificateCheck:
    """The agents' certificates after this tick's check: each one's expiry (status.certificates, the
    metrics), what was renewed now and why, or why a renewal failed."""

    secret: str
    expiry: dict[str, datetime] = field(default_factory=dict)
    renew_at: dict[str, datetime] = field(default_factory=dict)
    renewed: secrets.Renewal | None = None
    error: str | None = None

    @property
    def names(self) -> list[str]:
        return list(secrets.CERTIFICATES)

    def records(self) -> list[dict[str, str | None]]:
        return [
            {
                "name": name,
                "secret": self.secret,
                "notAfter": secrets.format_time(self.expiry[name]) if name in self.expiry else None,
                "renewAt": secrets.format_time(self.renew_at[name]) if name in self.renew_at else None,
            }
            for name in self.names
        ]


def _digest(body: JSON) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def secret_value(secret: JSON, key: str) -> str | None:
    data = (secret.get("data") or {}).get(key)
    if data is not None:
        return base64.b64decode(data).decode()
    value = (secret.get("stringData") or {}).get(key)
    return None if value is None else str(value)


class OwnedObjects:
    def __init__(self, api: KubeApi, config: OperatorConfig) -> None:
        self.api, self.config = api, config
        self._applied: dict[tuple[str, str], str] = {}
        self._secrets: AgentSecrets | None = None
        self._agent_secret: JSON | None = None  # the agents' Secret as last read or written
        self._issuer: dict[str, str] = {}  # the operator Secret's token, CA and CA key
        self._renew_error: tuple[float, str] | None = None  # (when to try again, why the last failed)
        self.blocked: list[str] = []  # StatefulSet fields that differ but cannot change in place
        self._ensured: tuple[object, ...] | None = None  # what the objects were last applied for

    def image(self, spec: PostgresClusterSpec) -> str:
        return common.resolve_image(spec, self.config.postgres_image, self.config.default_image)

    def ref(self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str) -> common.ClusterRef:
        meta = body["metadata"]
        return common.ClusterRef(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            spec=spec,
            image=image,
            revision=revision,
            log_format=self.config.log_format,
        )

    async def ensure(self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str) -> AgentSecrets:
        """Every owned object as the builders describe them. Nothing is built again while the cluster's
        spec (its generation), image and revision (a restart asked for changes it alone) stay as they
        were when all of them were last applied."""
        meta = body["metadata"]
        key = (meta.get("uid"), meta.get("generation"), image, revision)
        if self._secrets is not None and key[1] is not None and key == self._ensured:
            return self._secrets
        ref = self.ref(body, spec, image, revision)
        agent = await self._ensure_secrets(ref, rotate_request(meta))
        await self._apply("ServiceAccount", serviceaccount.service_account(ref))
        await self._apply("ConfigMap", configmap.configmap(ref))
        for service in services.services(ref):
            await self._apply("Service", service)
        budget = pdb.pdb(ref)
        if budget is None:
            await self._delete_owned("PodDisruptionBudget", names.pdb(ref.name), ref)
        else:
            await self._apply("PodDisruptionBudget", budget)
        policy = networkpolicy.network_policy(ref, self.config.operator_pods)
        if policy is None:
            await self._delete_owned("NetworkPolicy", names.network_policy(ref.name), ref)
        else:
            await self._apply("NetworkPolicy", policy)
        await self._ensure_statefulset(ref)
        self._ensured = key
        return agent

    async def agent_secrets(
        self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str
    ) -> AgentSecrets:
        """The agents' token and CA (the Secrets created once, then remembered): what the loop needs to
        observe its members, before anything else is reconciled."""
        if self._secrets is not None:
            return self._secrets
        return await self._ensure_secrets(
            self.ref(body, spec, image, revision), rotate_request(body["metadata"])
        )

    async def _ensure_secrets(self, ref: common.ClusterRef, rotate: str | None) -> AgentSecrets:
        if self._secrets is not None:
            return self._secrets
        operator_secret = await self._create_once(
            ref.namespace,
            names.secret_operator(ref.name),
            lambda: secrets.operator_secret(ref, secrets.generate_operator_data(ref.name)),
        )
        token = secret_value(operator_secret, names.KEY_TOKEN)
        ca_cert = secret_value(operator_secret, names.KEY_CA_CERT)
        ca_key = secret_value(operator_secret, names.KEY_CA_KEY)
        if not (token and ca_cert and ca_key):
            raise ApiError(
                422, "Invalid", f"Secret {names.secret_operator(ref.name)} lacks token, ca.crt or ca.key"
            )
        self._issuer = {names.KEY_TOKEN: token, names.KEY_CA_CERT: ca_cert, names.KEY_CA_KEY: ca_key}
        self._agent_secret = await self._create_once(
            ref.namespace,
            names.secret_agent(ref.name),
            lambda: secrets.agent_secret(
                ref,
                secrets.generate_agent_data(
                    ref.name, ref.namespace, self._issuer, lifetime=ref.spec.tls.lifetime
                ),
                rotated_for=rotate,
            ),
        )
        await self._create_once(
            ref.namespace,
            names.secret_superuser(ref.name),
            lambda: secrets.superuser_secret(ref, secrets.generate_superuser_data()),
        )
        await self._create_once(
            ref.namespace,
            names.secret_replication(ref.name),
            lambda: secrets.replication_secret(ref, secrets.generate_replication_data()),
        )
        app = await self._create_once(
            ref.namespace,
            names.secret_app(ref.name),
            lambda: secrets.app_secret(ref, secrets.generate_app_data(ref, ca_cert)),
        )
        upgraded = secrets.app_data_upgraded(ref, secrets.secret_values(app), ca_cert)
        if upgraded is not None:  # made before TLS: the CA and a verify-full URI, the password kept
            try:
                await self._replace_data(app, upgraded)
            except ApiError as exc:  # its old URI still connects (TLS, unverified): not worth stopping for
                log.warning(
                    "%s/%s: cannot add ca.crt to Secret %s: %s",
                    ref.namespace,
                    ref.name,
                    names.secret_app(ref.name),
                    exc,
                )
        namespace = ref.namespace
        self._secrets = AgentSecrets(
            token=token,
            ca_pem=ca_cert,
            server_hostname=lambda member: secrets.agent_server_hostname(ref.name, member, namespace),
        )
        return self._secrets

    async def certificates(
        self, ref: common.ClusterRef, rotate: str | None, now: datetime, may_act: Callable[[], bool]
    ) -> CertificateCheck:
        """The agents' certificates checked against `secrets.agent_certificate_due` (no request while
        nothing is due), and issued again when they are: the Secret read afresh (another operator may
        have renewed it), then its data replaced (PUT with its resourceVersion: a concurrent change
        makes it fail, to be tried again). Call after `agent_secrets`."""
        if self._agent_secret is None:
            await self._ensure_secrets(ref, rotate)
        assert self._agent_secret is not None
        name = names.secret_agent(ref.name)
        due = self._due(ref, self._agent_secret, rotate, now)
        if due is None:
            self._renew_error = None
            return self._check(name, self._agent_secret)
        if self._renew_error is not None and time.monotonic() < self._renew_error[0]:
            return self._check(name, self._agent_secret, error=self._renew_error[1])
        if not may_act():
            return self._check(name, self._agent_secret)
        why = due.message
        try:
            fresh = await self.api.get("Secret", ref.namespace, name)
            due = self._due(ref, fresh, rotate, now)
            if due is not None:
                data = secrets.secret_values(fresh)
                renewed = secrets.generate_agent_data(
                    ref.name,
                    ref.namespace,
                    self._issuer,
                    lifetime=ref.spec.tls.lifetime,
                    now=now,
                    token_sha256=data.get(names.KEY_TOKEN_DIGEST),
                )
                rotated = {names.ANNOTATION_ROTATED_FOR: rotate} if rotate is not None else {}
                fresh = await self._replace_data(fresh, renewed, rotated, kind="kubernetes.io/tls")
        except ApiError as exc:
            message = f"cannot renew the certificates of Secret {name} ({why}): {exc}"
            log.warning("%s/%s: %s", ref.namespace, ref.name, message)
            self._renew_error = (time.monotonic() + RENEW_RETRY, message)
            return self._check(name, self._agent_secret, error=message)
        self._agent_secret, self._renew_error = fresh, None
        return self._check(name, fresh, renewed=due)

    def _due(
        self, ref: common.ClusterRef, secret: JSON, rotate: str | None, now: datetime
    ) -> secrets.Renewal | None:
        annotations = secret["metadata"].get("annotations") or {}
        return secrets.agent_certificate_due(
            secrets.secret_values(secret),
            now,
            cluster=ref.name,
            namespace=ref.namespace,
            lifetime=ref.spec.tls.lifetime,
            ca_cert=self._issuer.get(names.KEY_CA_CERT),
            requested=rotate,
            renewed_for=annotations.get(names.ANNOTATION_ROTATED_FOR),
        )

    @staticmethod
    def _check(
        name: str, secret: JSON, *, renewed: secrets.Renewal | None = None, error: str | None = None
    ) -> CertificateCheck:
        data = secrets.secret_values(secret)
        expiry, renew_at = {}, {}
        for certificate, key in secrets.CERTIFICATES.items():
            try:
                facts = secrets.certificate_facts(data[key]) if data.get(key) else None
            except ValueError:
                facts = None
            if facts is not None:
                expiry[certificate], renew_at[certificate] = facts.not_after, facts.renew_at
        return CertificateCheck(name, expiry, renew_at, renewed, error)

    async def _replace_data(
        self,
        existing: JSON,
        data: Mapping[str, str],
        annotations: Mapping[str, str] | None = None,
        kind: str | None = None,
    ) -> JSON:
        """The Secret's data replaced whole, its metadata (labels, owners, annotations a person added)
        kept, `annotations` added; sent with the resourceVersion read (a concurrent writer gets 409)."""
        meta = {k: v for k, v in existing["metadata"].items() if k != "managedFields"}
        if annotations:
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": meta,
            "type": existing.get("type") or kind or "Opaque",
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()},
        }
        return await self.api.replace("Secret", meta["namespace"], meta["name"], body)

    async def _create_once(self, namespace: str, name: str, build: Callable[[], JSON]) -> JSON:
        found = await self.api.find("Secret", namespace, name)
        if found is not None:
            return found
        body = build()  # generated only when missing
        try:
            return await self.api.create("Secret", namespace, body)
        except ApiError as exc:
            if exc.conflict:  # created meanwhile (another operator): theirs stands
                return await self.api.get("Secret", namespace, name)
            raise

    async def _apply(self, kind: str, body: JSON) -> None:
        meta = body["metadata"]
        key = (kind, f"{meta['namespace']}/{meta['name']}")
        digest = _digest(body)
        known = self._applied.get(key)
        if known == digest:
            return
        patch = {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "status")}
        if kind == "Service":  # clusterIP and its kin are immutable and set by the API server
            patch["spec"] = {k: v for k, v in body["spec"].items() if k not in ("clusterIP", "clusterIPs")}
        # Applied before by this operator: most likely still there, patched at once (one request);
        # otherwise created, and patched only when it exists already.
        if known is not None and known != "deleted":
            try:
                await self.api.patch(kind, meta["namespace"], meta["name"], patch)
                self._applied[key] = digest
                return
            except ApiError as exc:
                if not exc.not_found:
                    raise
        try:
            await self.api.create(kind, meta["namespace"], body)
        except ApiError as exc:
            if not exc.conflict:
                raise
            await self.api.patch(kind, meta["namespace"], meta["name"], patch)
        self._applied[key] = digest

    async def _delete_owned(self, kind: str, name: str, ref: common.ClusterRef) -> None:
        key = (kind, f"{ref.namespace}/{name}")
        if self._applied.get(key) == "deleted":
            return
        found = await self.api.find(kind, ref.namespace, name)
        if found is not None and _owned_by(found, ref.uid):
            await self.api.delete(kind, ref.namespace, name)
        self._applied[key] = "deleted"

    async def _ensure_statefulset(self, ref: common.ClusterRef) -> None:
        key = ("StatefulSet", f"{ref.namespace}/{ref.name}")
        desired = statefulset.statefulset(ref, replicas=0)
        digest = _digest(desired)
        if self._applied.get(key) == digest:
            return
        existing = await self.api.find("StatefulSet", ref.namespace, names.statefulset(ref.name))
        if existing is None:
            try:
                await self.api.create("StatefulSet", ref.namespace, desired)
            except ApiError as exc:
                if not exc.conflict:
                    raise
            self._applied[key] = digest
            return
        self.blocked = statefulset.immutable_fields_changed(existing, desired)
        patch = statefulset.patchable(desired)
        patch.get("spec", {}).pop("replicas", None)
        await self.api.patch("StatefulSet", ref.namespace, names.statefulset(ref.name), patch)
        self._applied[key] = digest

    def snapshot_job(
        self,
        body: JSON,
        spec: PostgresClusterSpec,
        image: str,
        revision: str,
        backup: str,
        member: str,
        host: str,
    ) -> JSON:
        host_only, _, port = host.rpartition(":")
        return jobs.snapshot_job(
            self.ref(body, spec, image, revision),
            backup,
            host_only,
            source_port=int(port or names.POSTGRES_PORT),
            member=member,
        )

    def prune_job(
        self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str, action: Prune
    ) -> JSON:
        stamp = datetime.now(UTC).strftime("%Y%m%dt%H%M%S")
        return jobs.prune_job(
            self.ref(body, spec, image, revision), stamp, action.keep_last, action.keep_within
        )


async def expand_volumes(api: KubeApi, pvcs: list[JSON], spec: PostgresClusterSpec) -> list[str]:
    """Grow every member volume smaller than ``spec.storage.size`` (a StatefulSet's claim templates are
    immutable: the PVCs are patched one by one). Returns what the API server refused, for Events: a
    StorageClass without allowVolumeExpansion, or a shrink (never attempted)."""
    wanted = quantity(spec.storage.size)
    refused: list[str] = []
    for pvc in pvcs:
        name = pvc["metadata"]["name"]
        if not name.startswith(names.VOLUME_DATA + "-"):
            continue
        current = ((pvc.get("spec") or {}).get("resources") or {}).get("requests", {}).get("storage")
        if current is None:
            continue
        have = quantity(str(current))
        if not isinstance(have, Decimal) or not isinstance(wanted, Decimal) or have >= wanted:
            continue
        try:
            await api.patch(
                "PersistentVolumeClaim",
                pvc["metadata"]["namespace"],
                name,
                {"spec": {"resources": {"requests": {"storage": spec.storage.size}}}},
            )
            pvc["spec"]["resources"]["requests"]["storage"] = spec.storage.size
        except ApiError as exc:
            refused.append(f"volume {name} not expanded to {spec.storage.size}: {exc.message}")
    return refused


async def delete_volumes(api: KubeApi, cluster: str, pvcs: list[JSON]) -> list[str]:
    """Delete the cluster's member data volumes (``storage.deletePolicy: Delete``, when the cluster is
    deleted): the PVCs named ``pgdata-<cluster>-<ordinal>``. Kubernetes' PVC protection keeps each until
    its pod is gone. Returns the names deleted."""
    deleted = []
    for pvc in pvcs:
        name = str(pvc["metadata"]["name"])
        prefix, _, ordinal = name.rpartition("-")
        if prefix != f"{names.VOLUME_DATA}-{cluster}" or not ordinal.isdigit():
            continue
        if await api.delete("PersistentVolumeClaim", pvc["metadata"]["namespace"], name):
            deleted.append(name)
    return deleted


def _owned_by(obj: JSON, uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])
