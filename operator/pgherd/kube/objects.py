"""The objects a PostgresCluster owns, kept as the builders describe them.

- Secrets are created once (a password, token or CA is read back, never regenerated); the only data
  ever replaced are the certificates of the agents' Secret when `secrets.agent_certificate_due` says
  so (the CA and the token's digest kept) or PostgreSQL's files in it follow the user's certificates
  (spec.tls.serverCertSecret, clientCASecret: read by name, checked by `usercerts`, never installed
  when a check fails), and the app Secret's `ca.crt`, which follows the CA PostgreSQL's certificate
  chains to (a cluster made before TLS also gains a verify-full URI; the password is kept). The user's
  Secrets are only read, never written. Nothing secret is logged.
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
import marshal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pgherd.api.annotations import rotate_request
from pgherd.api.cluster import PostgresClusterSpec, Tls
from pgherd.engine.actions import Prune
from pgherd.kube import names, usercerts
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
from pgherd_backup.agent.tls import CertificateFacts, certificate_facts

if TYPE_CHECKING:
    from pgherd.kube.loop import OperatorConfig

log = logging.getLogger("pgherd.kube.objects")
JSON = dict[str, Any]


# After a refused renewal, the next attempt waits this long (seconds): a refusal (RBAC, a webhook) is
# not retried at every tick, and the condition CertificatesValid says why meanwhile.
RENEW_RETRY = 30.0
# The key of the stand-in for the agents' Secret while its check stands (`certificates`).
PARKED = "pgherd.parked"


@dataclass(frozen=True)
class AgentSecrets:
    token: str
    ca_pem: str
    server_hostname: Callable[[str], str | None]


@dataclass(frozen=True)
class UserCertificates:
    """The user's certificate Secrets as last read and checked: None where spec.tls names none."""

    server: usercerts.ServerCertificate | usercerts.Problem | None = None
    client_ca: usercerts.ClientCA | usercerts.Problem | None = None

    @property
    def problems(self) -> tuple[usercerts.Problem, ...]:
        return tuple(found for found in (self.server, self.client_ca) if isinstance(found, usercerts.Problem))


@dataclass(frozen=True)
class AgentUpdate:
    """The agents' Secret's data as it must become: `renewal` (the operator's certificates issued again,
    and why) and `updated` (what of the user's certificates PostgreSQL gets), for the Events."""

    data: dict[str, str]
    renewal: secrets.Renewal | None
    updated: str | None

    @property
    def why(self) -> str:
        return self.renewal.message if self.renewal is not None else self.updated or "PostgreSQL's files"


@dataclass(frozen=True)
class CertificateCheck:
    """The members' certificates after this tick's check: each one's expiry (status.certificates, the
    metrics; the user's own under their names in `USER_CERTIFICATES`), what was renewed or installed
    now and why, why a renewal failed, and what is wrong with the user's Secrets."""

    secret: str
    expiry: dict[str, datetime] = field(default_factory=dict)
    renew_at: dict[str, datetime] = field(default_factory=dict)
    renewed: secrets.Renewal | None = None
    error: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # a certificate of the user's -> its Secret
    problems: tuple[usercerts.Problem, ...] = ()
    updated: str | None = None
    # status.certificates, made once: a settled check is the same object at every tick (SettledCheck).
    _records: list[dict[str, str | None]] | None = field(default=None, init=False, repr=False, compare=False)
    _validity: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def names(self) -> list[str]:
        """The certificates pgherd issues."""
        return list(secrets.CERTIFICATES)

    def records(self) -> list[dict[str, str | None]]:
        """status.certificates (not to be changed: the same list is returned again)."""
        if self._records is None:
            object.__setattr__(self, "_records", self._make_records())
        assert self._records is not None
        return self._records

    def validity(self) -> str:
        """The first expiry and the first renewal, as the condition CertificatesValid says them (made
        once). Only for a check with its certificates' facts."""
        if self._validity is None:
            until, renew = min(self.expiry.values()), min(self.renew_at.values())
            text = f"valid until {secrets.format_time(until)}; renewed at {secrets.format_time(renew)}"
            object.__setattr__(self, "_validity", text)
        assert self._validity is not None
        return self._validity

    def _make_records(self) -> list[dict[str, str | None]]:
        issued: list[dict[str, str | None]] = [
            {
                "name": name,
                "secret": self.secret,
                "notAfter": secrets.format_time(self.expiry[name]) if name in self.expiry else None,
                "renewAt": secrets.format_time(self.renew_at[name]) if name in self.renew_at else None,
            }
            for name in self.names
        ]
        # The user's: their issuer renews them, so no renewAt.
        return issued + [
            {"name": name, "secret": secret, "notAfter": secrets.format_time(self.expiry[name])}
            for name, secret in self.sources.items()
            if name in self.expiry
        ]


NO_USER_CERTIFICATES = UserCertificates()


@dataclass(frozen=True)
class SettledCheck:
    """A certificate check that found nothing to do, and what it read: it stands, and is returned again
    without decoding the Secret, while the agents' Secret is the same object (as last read or written),
    its other inputs are equal (`inputs`: the rotate request, the cluster's names, spec.tls, the user's
    certificates as last read and checked, the cluster CA), and `now` is before `until`, the next
    renewal point of its certificates (from then on, two thirds of a lifetime have passed)."""

    secret: JSON
    inputs: tuple[object, ...]
    until: datetime
    check: CertificateCheck
    postgres_ca: str | None  # the CA PostgreSQL's certificate chains to, which the app Secret follows


# The user's certificates as status.certificates and the metrics name them.
USER_CERTIFICATES = {"postgres": names.KEY_POSTGRES_CERT, "clientCA": names.KEY_CLIENT_CA}


def _digest(body: JSON) -> str:
    """Whether an owned object built again differs from the one last applied. marshal's version 0 writes
    values alone (no references to objects seen before, no interning): equal values in the builders' own
    order give equal bytes, at a third of JSON's cost, which every cluster pays at each new generation.
    A value of a subclass (an enum member from a model) is no marshal type: such an object is hashed from
    its JSON, as the API client sends it."""
    try:
        data = marshal.dumps(body, 0)
    except ValueError:
        data = json.dumps(body, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


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
        self._decoded: tuple[JSON, dict[str, str]] | None = None  # a Secret and its values, decoded once
        self._settled: SettledCheck | None = None  # the last check that found nothing to do
        self._issuer: dict[str, str] = {}  # the operator Secret's token, CA and CA key
        self._renew_error: tuple[float, str] | None = None  # (when to try again, why the last failed)
        # The user's certificate Secrets, as last read (when, and for which spec.tls and instances).
        self._user = UserCertificates()
        self._user_read: tuple[float, tuple[object, ...]] | None = None
        self._app_ca: str | None = None  # the app Secret's ca.crt, as last read or written
        self._app_retry = 0.0  # after a refused write of the app Secret: not before then
        self.blocked: list[str] = []  # StatefulSet fields that differ but cannot change in place
        self._ensured: tuple[object, ...] | None = None  # what the objects were last applied for
        self._ref: common.ClusterRef | None = None  # the last `ref`

    def image(self, spec: PostgresClusterSpec) -> str:
        return common.resolve_image(spec, self.config.postgres_image, self.config.default_image)

    def ref(self, body: JSON, spec: PostgresClusterSpec, image: str, revision: str) -> common.ClusterRef:
        """The cluster as the builders need it; the same object again while its parts are (the loop
        parses the spec once per generation: a settled tick asks for it with the same spec)."""
        meta = body["metadata"]
        last = self._ref
        if (
            last is not None
            and last.spec is spec
            and last.image == image
            and last.revision == revision
            and last.uid == meta["uid"]
            and last.name == meta["name"]
            and last.namespace == meta["namespace"]
        ):
            return last
        self._ref = common.ClusterRef(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            spec=spec,
            image=image,
            revision=revision,
            log_format=self.config.log_format,
        )
        return self._ref

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
        self._agent_secret = _kept(
            await self._create_once(
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
        app_data = secrets.secret_values(app)
        self._app_ca = app_data.get(names.KEY_CA_CERT)
        upgraded = secrets.app_data_upgraded(ref, app_data, ca_cert)
        if upgraded is not None:  # made before TLS: the CA and a verify-full URI, the password kept
            try:
                await self._replace_data(app, upgraded)
                self._app_ca = upgraded[names.KEY_CA_CERT]
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
        """The agents' Secret checked against what it must hold (`_plan`: no request while nothing is
        due and the user's Secrets, read again every `certificate_secrets_interval`, are unchanged), and
        its data replaced when it differs: the Secret read afresh (another operator may have renewed
        it), then replaced (PUT with its resourceVersion: a concurrent change makes it fail, to be tried
        again). Then the app Secret's ca.crt follows. Call after `agent_secrets`.

        A check that found nothing to do is returned again, the Secret neither decoded nor checked, until
        an input changes or time reaches a renewal point (`SettledCheck`): at every tick of thousands of
        clusters, that check was a few percent of the operator's CPU."""
        if self._agent_secret is None:
            await self._ensure_secrets(ref, rotate)
        assert self._agent_secret is not None
        name = names.secret_agent(ref.name)
        user = await self._user_certificates(ref, now)
        inputs = (rotate, ref.name, ref.namespace, ref.spec.tls, user, self._issuer.get(names.KEY_CA_CERT))
        settled = self._settled
        if (
            settled is not None
            and settled.secret is self._agent_secret
            and settled.inputs == inputs
            and now < settled.until
        ):
            self._renew_error = None
            await self._follow_app_ca(ref, may_act, settled.postgres_ca)
            return settled.check
        if settled is not None and settled.secret is self._agent_secret and PARKED in self._agent_secret:
            # Due again (an input changed, or a renewal point came): the Secret, parked while the check
            # stood, is read again, as another operator may have renewed it meanwhile.
            if self._renew_error is not None and time.monotonic() < self._renew_error[0]:
                return replace(settled.check, error=self._renew_error[1])
            try:
                self._agent_secret = _kept(await self.api.get("Secret", ref.namespace, name))
            except ApiError as exc:
                message = f"cannot read Secret {name} to check its certificates: {exc}"
                log.warning("%s/%s: %s", ref.namespace, ref.name, message)
                self._renew_error = (time.monotonic() + RENEW_RETRY, message)
                return replace(settled.check, error=message)
        plan = self._plan(ref, self._agent_secret, rotate, now, user)
        if plan is None:
            self._renew_error = None
            data = self._values(self._agent_secret)
            await self._follow_app_ca(ref, may_act, data.get(names.KEY_POSTGRES_CA))
            check = self._check(name, self._agent_secret, user, ref.spec.tls, data=data)
            self._settled = _settled(self._agent_secret, inputs, now, check, data.get(names.KEY_POSTGRES_CA))
            if self._settled is not None:
                # Neither the Secret nor its values are read until the check is due again: a settled
                # cluster keeps its name only (11 KB less for each cluster, 22 MB at 2,000).
                self._decoded = None
                self._agent_secret = {PARKED: True, "metadata": {"name": name}}
                self._settled = replace(self._settled, secret=self._agent_secret)
            return check
        if self._renew_error is not None and time.monotonic() < self._renew_error[0]:
            return self._check(
                name,
                self._agent_secret,
                user,
                ref.spec.tls,
                error=self._renew_error[1],
                data=self._values(self._agent_secret),
            )
        if not may_act():
            return self._check(
                name, self._agent_secret, user, ref.spec.tls, data=self._values(self._agent_secret)
            )
        why = plan.why
        try:
            fresh = await self.api.get("Secret", ref.namespace, name)
            plan = self._plan(ref, fresh, rotate, now, user)
            if plan is not None:
                rotated = (
                    {names.ANNOTATION_ROTATED_FOR: rotate}
                    if rotate is not None and plan.renewal is not None
                    else {}
                )
                fresh = await self._replace_data(fresh, plan.data, rotated, kind="kubernetes.io/tls")
        except ApiError as exc:
            message = f"cannot renew the certificates of Secret {name} ({why}): {exc}"
            log.warning("%s/%s: %s", ref.namespace, ref.name, message)
            self._renew_error = (time.monotonic() + RENEW_RETRY, message)
            return self._check(
                name,
                self._agent_secret,
                user,
                ref.spec.tls,
                error=message,
                data=self._values(self._agent_secret),
            )
        fresh = _kept(fresh)
        self._agent_secret, self._renew_error = fresh, None
        await self._follow_app_ca(ref, may_act, self._values(fresh).get(names.KEY_POSTGRES_CA))
        if plan is None:
            return self._check(name, fresh, user, ref.spec.tls, data=self._values(fresh))
        return self._check(
            name,
            fresh,
            user,
            ref.spec.tls,
            renewed=plan.renewal,
            updated=plan.updated,
            data=self._values(fresh),
        )

    async def _user_certificates(self, ref: common.ClusterRef, now: datetime) -> UserCertificates:
        """spec.tls's Secrets, read by name (the operator may not list or watch Secrets) and checked;
        read again every `certificate_secrets_interval` seconds, and at once when spec.tls or the
        number of instances (the names the certificate must cover) changed."""
        tls = ref.spec.tls
        key: tuple[object, ...] = (tls.server_cert_secret, tls.client_ca_secret, ref.spec.instances)
        if tls.server_cert_secret is None and tls.client_ca_secret is None:
            self._user, self._user_read = NO_USER_CERTIFICATES, None
            return self._user
        interval = self.config.certificate_secrets_interval
        read = self._user_read
        if read is not None and read[1] == key and time.monotonic() - read[0] < interval:
            return self._user
        server: usercerts.ServerCertificate | usercerts.Problem | None = None
        client: usercerts.ClientCA | usercerts.Problem | None = None
        if tls.server_cert_secret is not None:
            found = await self._user_secret(ref, tls.server_cert_secret, usercerts.SERVER_FIELD)
            server = (
                found
                if isinstance(found, usercerts.Problem)
                else usercerts.check_server(
                    tls.server_cert_secret,
                    found,
                    cluster=ref.name,
                    namespace=ref.namespace,
                    instances=ref.spec.instances,
                    now=now,
                )
            )
        if tls.client_ca_secret is not None:
            found = await self._user_secret(ref, tls.client_ca_secret, usercerts.CLIENT_CA_FIELD)
            client = (
                found
                if isinstance(found, usercerts.Problem)
                else usercerts.check_client_ca(tls.client_ca_secret, found, namespace=ref.namespace, now=now)
            )
        self._user, self._user_read = UserCertificates(server, client), (time.monotonic(), key)
        return self._user

    async def _user_secret(
        self, ref: common.ClusterRef, name: str, spec_field: str
    ) -> JSON | usercerts.Problem | None:
        try:
            return await self.api.find("Secret", ref.namespace, name)
        except ApiError as exc:
            return usercerts.Problem(
                name, "SecretUnreadable", f"Secret {name} ({spec_field}) cannot be read: {exc}"
            )

    def _plan(
        self, ref: common.ClusterRef, secret: JSON, rotate: str | None, now: datetime, user: UserCertificates
    ) -> AgentUpdate | None:
        """What the agents' Secret must hold, or None when it holds it. The operator's certificates are
        issued again when `secrets.agent_certificate_due` says so; PostgreSQL's files are the user's
        certificates that passed their checks, else the operator's, except that a user's certificate
        already installed stays while its Secret fails a check (the members keep serving it)."""
        current = self._values(secret)
        installed_server = self._installed_server(current)
        installed_client = self._installed_client_ca(current)
        client_ca = user.client_ca if isinstance(user.client_ca, usercerts.ClientCA) else None
        # The user's CA cannot sign now, and its certificate is what PostgreSQL trusts: keep it all.
        hold = isinstance(user.client_ca, usercerts.Problem) and installed_client is not None
        annotations = secret["metadata"].get("annotations") or {}
        renewal = secrets.agent_certificate_due(
            current,
            now,
            cluster=ref.name,
            namespace=ref.namespace,
            lifetime=ref.spec.tls.lifetime,
            ca_cert=self._issuer.get(names.KEY_CA_CERT),
            client_ca_cert=None if client_ca is None else client_ca.cert,
            hold_replication=hold,
            requested=rotate,
            renewed_for=annotations.get(names.ANNOTATION_ROTATED_FOR),
        )
        data = dict(current)
        if renewal is not None:
            issued = secrets.generate_agent_data(
                ref.name,
                ref.namespace,
                self._issuer,
                lifetime=ref.spec.tls.lifetime,
                now=now,
                token_sha256=current.get(names.KEY_TOKEN_DIGEST),
                client_ca=client_ca,
            )
            kept = (names.KEY_REPLICATION_CERT, names.KEY_REPLICATION_KEY) if hold else ()
            data.update({key: issued[key] for key in secrets.ISSUED_KEYS if key not in kept})
        server = user.server
        if isinstance(server, usercerts.ServerCertificate):
            server_files: tuple[str, str, str] | None = (server.cert, server.key, server.ca)
        else:
            server_files = installed_server if isinstance(server, usercerts.Problem) else None
        client_roots: str | None
        if client_ca is not None:
            client_roots = client_ca.roots
        else:
            client_roots = installed_client if isinstance(user.client_ca, usercerts.Problem) else None
        data.update(secrets.postgres_tls_data(data, server=server_files, client_ca=client_roots))
        if data == current:
            return None
        return AgentUpdate(data, renewal, self._describe_update(current, data, user))

    def _values(self, secret: JSON) -> dict[str, str]:
        """The Secret's values, decoded once per Secret object (the agents' Secret as last read or
        written is asked for by the plan, the check and the app Secret's CA). Not to be changed."""
        decoded = self._decoded
        if decoded is None or decoded[0] is not secret:
            decoded = self._decoded = (secret, secrets.secret_values(secret))
        return decoded[1]

    @staticmethod
    def _installed_server(data: Mapping[str, str]) -> tuple[str, str, str] | None:
        """PostgreSQL's server files when they are the user's (not a copy of the agent's own)."""
        cert = data.get(names.KEY_POSTGRES_CERT)
        if not cert or cert == data.get(names.KEY_TLS_CERT):
            return None
        return cert, data.get(names.KEY_POSTGRES_KEY, ""), data.get(names.KEY_POSTGRES_CA, "")

    @staticmethod
    def _installed_client_ca(data: Mapping[str, str]) -> str | None:
        """The CAs PostgreSQL takes client certificates from when they are the user's."""
        roots = data.get(names.KEY_CLIENT_CA)
        return roots if roots and roots != data.get(names.KEY_CA_CERT) else None

    @staticmethod
    def _describe_update(
        current: Mapping[str, str], data: Mapping[str, str], user: UserCertificates
    ) -> str | None:
        """What of the user's certificates PostgreSQL gets with `data` (an Event's note), or None when
        only the operator's own files moved."""
        said: list[str] = []
        if data[names.KEY_POSTGRES_CERT] != current.get(names.KEY_POSTGRES_CERT):
            if isinstance(user.server, usercerts.ServerCertificate):
                said.append(
                    f"PostgreSQL serves the certificate of Secret {user.server.secret} (serial"
                    f" {user.server.serial:x}, until {secrets.format_time(user.server.not_after)})"
                )
            elif OwnedObjects._installed_server(current) is not None:
                said.append("PostgreSQL serves the cluster CA's certificate again")
        if data[names.KEY_CLIENT_CA] != current.get(names.KEY_CLIENT_CA):
            if isinstance(user.client_ca, usercerts.ClientCA):
                said.append(
                    f"it accepts client certificates of the CA of Secret {user.client_ca.secret}, which"
                    " signed the replication certificate"
                )
            elif OwnedObjects._installed_client_ca(current) is not None:
                said.append("it accepts client certificates of the cluster CA again")
        if not said:
            return None
        return "; ".join(said) + ": the members reload it without a restart"

    async def _follow_app_ca(
        self, ref: common.ClusterRef, may_act: Callable[[], bool], wanted: str | None
    ) -> None:
        """The app Secret's ca.crt made the CA PostgreSQL's certificate chains to (the user's, or the
        cluster's), its other keys kept: clients that verify keep verifying. A refused write is logged
        and tried again later: their old CA keeps working until the members reload."""
        if not wanted or wanted == self._app_ca or time.monotonic() < self._app_retry or not may_act():
            return
        name = names.secret_app(ref.name)
        try:
            app = await self.api.get("Secret", ref.namespace, name)
            data = secrets.secret_values(app)
            if data.get(names.KEY_CA_CERT) != wanted:
                await self._replace_data(app, {**data, names.KEY_CA_CERT: wanted})
            self._app_ca = wanted
        except ApiError as exc:
            log.warning("%s/%s: cannot write ca.crt into Secret %s: %s", ref.namespace, ref.name, name, exc)
            self._app_retry = time.monotonic() + RENEW_RETRY

    @staticmethod
    def _check(
        name: str,
        secret: JSON,
        user: UserCertificates | None = None,
        tls: Tls | None = None,
        *,
        renewed: secrets.Renewal | None = None,
        updated: str | None = None,
        error: str | None = None,
        data: Mapping[str, str] | None = None,
    ) -> CertificateCheck:
        """What the agents' Secret `name` holds, as status.certificates and the condition read it (the
        user's certificates under the Secret names of `tls`). `data`: its values, when decoded already."""
        user = user or NO_USER_CERTIFICATES
        data = secrets.secret_values(secret) if data is None else data
        expiry, renew_at = {}, {}
        for certificate, key in secrets.CERTIFICATES.items():
            facts = _facts(data.get(key))
            if facts is not None:
                expiry[certificate], renew_at[certificate] = facts.not_after, facts.renew_at
        sources: dict[str, str] = {}
        named = (None, None) if tls is None else (tls.server_cert_secret, tls.client_ca_secret)
        for certificate, secret_name, installed in (
            ("postgres", named[0], OwnedObjects._installed_server(data) is not None),
            ("clientCA", named[1], OwnedObjects._installed_client_ca(data) is not None),
        ):
            facts = _facts(data.get(USER_CERTIFICATES[certificate])) if installed else None
            if facts is not None and secret_name is not None:
                expiry[certificate], sources[certificate] = facts.not_after, secret_name
        return CertificateCheck(
            name,
            expiry,
            renew_at,
            renewed,
            error,
            sources=sources,
            problems=user.problems,
            updated=updated,
        )

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
                await self.api.patch(kind, meta["namespace"], meta["name"], patch, answer=False)
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
        await self.api.patch("StatefulSet", ref.namespace, names.statefulset(ref.name), patch, answer=False)
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


def _settled(
    secret: JSON, inputs: tuple[object, ...], now: datetime, check: CertificateCheck, postgres_ca: str | None
) -> SettledCheck | None:
    """`check` kept for its inputs until the next renewal point of its certificates after `now` (the
    only way time changes what `_plan` finds); None when no renewal point lies ahead."""
    ahead = [at for at in check.renew_at.values() if at > now]
    return SettledCheck(secret, inputs, min(ahead), check, postgres_ca) if ahead else None


def _kept(secret: JSON) -> JSON:
    """A Secret as the loop keeps it between ticks: without metadata.managedFields (its write history,
    which nothing here reads: a few KB for each cluster)."""
    meta = secret.get("metadata") or {}
    if "managedFields" not in meta:
        return secret
    return {**secret, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


def _facts(pem: str | None) -> CertificateFacts | None:
    try:
        return certificate_facts(pem) if pem else None
    except ValueError:
        return None


def _owned_by(obj: JSON, uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])
