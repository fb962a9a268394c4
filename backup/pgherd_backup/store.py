"""The S3 object store: where it is, how to reach it, and the few operations the agent needs.

Every request goes through `Store._call`, which retries transient failures a bounded number of
times (tenacity) and turns the others into one `StoreError` naming the operation, the object and
what to check. boto3 is imported lazily: `wal-push` runs once per WAL segment and its start-up
time matters.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import ssl
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from pgherd_backup.errors import ObjectMissing, StoreError
from pgherd_backup.s3lite import CABundleError, Credentials, ListPage, LiteS3, LiteS3Error, tls_context

T = TypeVar("T")

_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
    "403",
    "Forbidden",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "500",
    "502",
    "503",
    "504",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class StoreLocation:
    """`s3://bucket/path` plus the cluster name: the root of one cluster's archives."""

    bucket: str
    path: str
    cluster: str

    @classmethod
    def parse(cls, url: str, cluster: str) -> StoreLocation:
        match = re.fullmatch(r"s3://([^/]+)/?(.*)", url.strip())
        if not match:
            raise StoreError(f"invalid store URL {url!r}: expected s3://bucket/path")
        if not cluster or "/" in cluster:
            raise StoreError(f"invalid cluster name {cluster!r}: expected a non-empty name without '/'")
        return cls(bucket=match.group(1), path=match.group(2).strip("/"), cluster=cluster)

    @property
    def cluster_prefix(self) -> str:
        """Key prefix (ending in '/') of every object of this cluster, across system ids."""
        return f"{self.path}/{self.cluster}/" if self.path else f"{self.cluster}/"

    def system_prefix(self, system_id: str) -> str:
        return f"{self.cluster_prefix}{system_id}/"

    def url(self) -> str:
        return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"


@dataclass(frozen=True)
class S3Settings:
    """How to reach S3: endpoint, region and credentials (standard AWS variables by default), and the CA
    bundle an https endpoint is verified with (AWS_CA_BUNDLE: its certificates alone; unset, the
    system's)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    force_path_style: bool | None = None
    sign_payload: bool = False
    retries: int = 5
    lite: bool = True
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    ca_bundle: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> S3Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "endpoint_url": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
            "access_key_id": env.get("AWS_ACCESS_KEY_ID") or None,
            "secret_access_key": env.get("AWS_SECRET_ACCESS_KEY") or None,
            "session_token": env.get("AWS_SESSION_TOKEN") or None,
            "ca_bundle": env.get("AWS_CA_BUNDLE") or None,
            "lite": env.get("PGHERD_S3_LITE", "1") not in {"0", "false", "no"},
            "sign_payload": env.get("PGHERD_S3_SIGN_PAYLOAD", "") in {"1", "true", "yes"},
        }
        if env.get("PGHERD_S3_FORCE_PATH_STYLE"):
            values["force_path_style"] = env["PGHERD_S3_FORCE_PATH_STYLE"] in {"1", "true", "yes"}
        if env.get("PGHERD_S3_RETRIES"):
            values["retries"] = max(1, int(env["PGHERD_S3_RETRIES"]))
        if env.get("PGHERD_S3_CONNECT_TIMEOUT"):
            values["connect_timeout"] = float(env["PGHERD_S3_CONNECT_TIMEOUT"])
        if env.get("PGHERD_S3_READ_TIMEOUT"):
            values["read_timeout"] = float(env["PGHERD_S3_READ_TIMEOUT"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return ""


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, OSError | http.client.HTTPException):
        return True
    if "botocore.exceptions" not in sys.modules:  # botocore not even loaded: not one of its errors
        return False
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return isinstance(exc, BotoConnectionError | HTTPClientError)


def _verification_failure(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind `exc`, if that is what it is: raised as it is by the
    small client, wrapped by botocore (its SSLError's `error`) and urllib3 (an argument, or the cause)."""
    pending: list[object] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return current
        kwargs = getattr(current, "kwargs", None)
        pending += [current.__cause__, current.__context__, *current.args]
        if isinstance(kwargs, dict):
            pending.append(kwargs.get("error"))
    return None


def _is_transient(exc: BaseException) -> bool:
    if _verification_failure(exc) is not None:
        return False  # the same certificate answers again: a person must act
    if _is_connection_error(exc):
        return True
    return _error_code(exc) in _TRANSIENT_CODES


class Store:
    """One cluster's archive in S3. Thread-safe: the S3 client is shared by worker threads.

    With static credentials (the AWS_* variables or flags) requests go through the small built-in
    client (`s3lite`); otherwise, or with PGHERD_S3_LITE=0, through boto3.
    """

    def __init__(
        self, location: StoreLocation, settings: S3Settings | None = None, *, pool: int = 16
    ) -> None:
        self.location = location
        self.settings = settings or S3Settings.from_env()
        self._pool = pool
        self._backend: LiteS3 | Any = None
        s = self.settings
        if s.lite and s.access_key_id and s.secret_access_key:
            self._backend = LiteS3(
                s.endpoint_url,
                s.region or "us-east-1",
                Credentials(s.access_key_id, s.secret_access_key, s.session_token),
                path_style=self._path_style,
                timeout=s.read_timeout,
                connect_timeout=s.connect_timeout,
                ca_bundle=s.ca_bundle,
            )

    @property
    def _path_style(self) -> bool:
        s = self.settings
        return bool(s.force_path_style or (s.force_path_style is None and s.endpoint_url))

    @property
    def _https(self) -> bool:
        return not self.settings.endpoint_url or self.settings.endpoint_url.startswith("https:")

    @property
    def bucket(self) -> str:
        return self.location.bucket

    @property
    def endpoint(self) -> str:
        return self.settings.endpoint_url or "the default AWS S3 endpoint"

    @property
    def backend(self) -> Any:
        if self._backend is None:
            from pgherd_backup.s3boto import BotoS3

            if self.settings.ca_bundle and self._https:
                tls_context(self.settings.ca_bundle)  # CABundleError now, rather than botocore's later
            self._backend = BotoS3(self._make_client())
        return self._backend

    def _make_client(self) -> Any:
        import boto3
        from botocore.config import Config

        s = self.settings
        s3_options: dict[str, Any] = {"payload_signing_enabled": s.sign_payload}
        if self._path_style:
            s3_options["addressing_style"] = "path"
        config_args: dict[str, Any] = {
            "max_pool_connections": self._pool,
            "retries": {"max_attempts": 1, "mode": "standard"},
            "connect_timeout": s.connect_timeout,
            "read_timeout": s.read_timeout,
            "tcp_keepalive": True,
            "s3": s3_options,
            "signature_version": "s3v4",
        }
        try:
            config = Config(
                **config_args,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
        except TypeError:  # botocore older than 1.36 has no flexible checksums to turn off
            config = Config(**config_args)
        return boto3.session.Session().client(
            "s3",
            endpoint_url=s.endpoint_url,
            region_name=s.region or "us-east-1",
            aws_access_key_id=s.access_key_id,
            aws_secret_access_key=s.secret_access_key,
            aws_session_token=s.session_token,
            verify=s.ca_bundle,  # None: the system's CAs (never False: always verified)
            config=config,
        )

    # -- error handling -------------------------------------------------------------------------

    def _translate(self, exc: BaseException, action: str, key: str | None) -> StoreError:
        where = f"s3://{self.bucket}/{key}" if key else f"bucket {self.bucket!r}"
        code = _error_code(exc)
        if isinstance(exc, CABundleError):
            return self._unusable_ca_bundle(exc)
        failure = _verification_failure(exc)
        if failure is not None:
            return self._untrusted(failure, action, where)
        if _is_connection_error(exc):
            return StoreError(
                f"cannot reach the S3 endpoint {self.endpoint} while {action} {where}: {exc}. "
                "Check AWS_ENDPOINT_URL (or --endpoint) and that the object store is up."
            )
        if code == "NoSuchBucket":
            return StoreError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint} (while {action} {where}). "
                "Create the bucket or fix the --store URL."
            )
        if code in _CREDENTIAL_CODES:
            return StoreError(
                f"S3 refused the credentials ({code}) while {action} {where}. "
                "Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's access policy."
            )
        if code in _MISSING_CODES and key is not None:
            return ObjectMissing(f"object {where} does not exist", key)
        if type(exc).__name__ == "NoCredentialsError":
            return StoreError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        detail = str(exc) or type(exc).__name__
        return StoreError(f"S3 request failed while {action} {where}: {detail}")

    def _untrusted(self, failure: ssl.SSLCertVerificationError, action: str, where: str) -> StoreError:
        reason = failure.verify_message or str(failure)
        bundle = self.settings.ca_bundle
        if bundle:
            return StoreError(
                f"the S3 endpoint {self.endpoint} presented a certificate that the CA bundle {bundle}"
                f" (AWS_CA_BUNDLE) does not verify ({reason}) while {action} {where}. Check that this CA"
                " (backup.store.s3.endpointCA on Kubernetes) signed the endpoint's certificate, and that"
                " the certificate names the endpoint's host."
            )
        return StoreError(
            f"the S3 endpoint {self.endpoint} presented a certificate that the system's CA certificates do"
            f" not verify ({reason}) while {action} {where}. If a private CA signed it (a MinIO with its"
            " own CA), name a Secret holding that CA in backup.store.s3.endpointCA (on Kubernetes), or set"
            " AWS_CA_BUNDLE to its file."
        )

    def _unusable_ca_bundle(self, exc: CABundleError) -> StoreError:
        """The CA bundle is missing or unusable: the endpoint cannot be verified, so is not asked."""
        hint = {
            "does not exist": (
                "on Kubernetes, the Secret named by backup.store.s3.endpointCA, or its key, is missing:"
                " create it, or fix the name"
            ),
            "holds no PEM certificate": "it must hold the endpoint's CA certificate(s), PEM-encoded",
        }.get(exc.problem, "check its permissions")
        return StoreError(
            f"the CA bundle {exc.path} (AWS_CA_BUNDLE) {exc.problem}: the S3 endpoint {self.endpoint}"
            f" cannot be verified; {hint}"
        )

    def _call(self, action: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one request, retrying transient failures with exponential back-off."""

        def give_up(state: RetryCallState) -> T:
            outcome = state.outcome
            assert outcome is not None
            exc = outcome.exception()
            assert exc is not None
            raise self._translate(exc, action, key) from None

        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_attempt(self.settings.retries),
            wait=wait_exponential(multiplier=0.2, max=5),
            retry_error_callback=give_up,
            reraise=False,
        )
        try:
            return retrying(fn)
        except StoreError:
            raise
        except (LiteS3Error, CABundleError) as exc:
            raise self._translate(exc, action, key) from None
        except Exception as exc:
            if _verification_failure(exc) is not None:
                raise self._translate(exc, action, key) from None
            if "botocore.exceptions" in sys.modules:
                from botocore.exceptions import BotoCoreError, ClientError

                if isinstance(exc, ClientError | BotoCoreError):
                    raise self._translate(exc, action, key) from None
            raise

    # -- operations -----------------------------------------------------------------------------

    def check(self) -> None:
        """Fail early, with a clear message, when the bucket is unreachable, missing or forbidden."""
        self._call("checking", None, lambda: self.backend.head_bucket(self.bucket))

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self._call("uploading", key, lambda: self.backend.put(self.bucket, key, data, content_type))

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """The object's bytes; `byte_range` is (first, last) inclusive."""
        data: bytes = self._call("downloading", key, lambda: self.backend.get(self.bucket, key, byte_range))
        return data

    def head(self, key: str) -> ObjectInfo | None:
        found = self._call("inspecting", key, lambda: self.backend.head(self.bucket, key))
        return ObjectInfo(key, found[0], found[1]) if found else None

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[ListPage]:
        token: str | None = None
        while True:

            def fetch(current: str | None = token) -> ListPage:
                page: ListPage = self.backend.list_page(self.bucket, prefix, delimiter, current)
                return page

            page = self._call("listing", prefix, fetch)
            yield page
            if not page.next_token:
                return
            token = page.next_token

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        for page in self._pages(prefix, None):
            for key, size, modified in page.objects:
                yield ObjectInfo(key, size, modified)

    def list_prefixes(self, prefix: str) -> list[str]:
        """The "sub-directories" right under `prefix` (which ends in '/'), without the prefix."""
        return [p[len(prefix) :].rstrip("/") for page in self._pages(prefix, "/") for p in page.prefixes]

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]

            def delete_batch(b: list[str] = batch) -> list[tuple[str, str, str]]:
                refused: list[tuple[str, str, str]] = self.backend.delete_many(self.bucket, b)
                return refused

            errors = self._call("deleting", batch[0], delete_batch)
            if errors:
                key, code, message = errors[0]
                raise StoreError(f"S3 refused to delete s3://{self.bucket}/{key}: {code} {message}")

    # -- multipart uploads ----------------------------------------------------------------------

    def start_multipart(self, key: str) -> str:
        upload_id: str = self._call(
            "starting the upload of", key, lambda: self.backend.create_multipart(self.bucket, key)
        )
        return upload_id

    def upload_part(
        self, key: str, upload_id: str, number: int, data: bytes, sha256: str | None = None
    ) -> str:
        etag: str = self._call(
            f"uploading part {number} of",
            key,
            lambda: self.backend.upload_part(self.bucket, key, upload_id, number, data, sha256),
        )
        return etag

    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> None:
        self._call(
            "completing the upload of",
            key,
            lambda: self.backend.complete_multipart(self.bucket, key, upload_id, etags),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Best effort: an abort that fails leaves an invisible upload, never a visible object."""
        with contextlib.suppress(Exception):
            self.backend.abort_multipart(self.bucket, key, upload_id)
