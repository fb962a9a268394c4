"""A minimal S3 client (GET, PUT, HEAD of one object, AWS Signature V4) for the hot path.

archive_command and restore_command start one process per WAL file; creating a boto3 client costs
about half a second of CPU, this costs a few milliseconds. It is used only with static credentials
from the environment; everything else (listing, multipart uploads, other credential sources)
goes through boto3.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import http.client
import re
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from xml.etree import ElementTree
from xml.sax.saxutils import escape

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
MAX_IDLE = 16  # idle connections kept per host


class LiteS3Error(Exception):
    """An S3 error response: `code` is S3's error code (or the HTTP status when there is none)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.status = status
        self.code = code
        self.response = {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }


class CABundleError(Exception):
    """The CA bundle an https endpoint is to be verified with cannot be used (`problem` says why)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"the CA bundle {path} {problem}")
        self.path = path
        self.problem = problem


def tls_context(ca_bundle: str | None) -> ssl.SSLContext:
    """What an https endpoint is verified with: the certificates of `ca_bundle` alone (a private CA, as
    botocore's `verify=` takes it), else the system's. Never unverified."""
    if ca_bundle is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except FileNotFoundError:
        raise CABundleError(ca_bundle, "does not exist") from None
    except ssl.SSLError:  # before OSError, its base: the file reads but holds no certificate
        raise CABundleError(ca_bundle, "holds no PEM certificate") from None
    except OSError as exc:
        raise CABundleError(ca_bundle, f"cannot be read ({exc.strerror})") from None


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def _quote(path: str) -> str:
    return urllib.parse.quote(path, safe="/~")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


class LiteS3:
    def __init__(
        self,
        endpoint_url: str | None,
        region: str,
        credentials: Credentials,
        *,
        path_style: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        ca_bundle: str | None = None,
    ) -> None:
        self.region = region
        self.ca_bundle = ca_bundle
        self._tls: ssl.SSLContext | None = None
        self.credentials = credentials
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        if endpoint_url:
            parsed = urllib.parse.urlsplit(endpoint_url)
            self.scheme = parsed.scheme or "https"
            self.netloc = parsed.netloc
        else:
            self.scheme, self.netloc = "https", f"s3.{region}.amazonaws.com"
        self.path_style = path_style
        # Idle connections by host, shared by the threads (each takes one for a request and gives it
        # back): the WAL service answers each request in a thread of its own, and a connection per
        # thread cost a TCP and TLS handshake per restore_command, inside a switchover's outage.
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._idle_lock = threading.Lock()
        self.connections_made = 0
        self.requests_made = 0

    def _take(self, host: str) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to `host`, and whether it served a request before (it may have been closed by
        the server since)."""
        with self._idle_lock:
            idle = self._idle.get(host)
            if idle:
                return idle.pop(), True
            self.connections_made += 1
        if self.scheme == "https":
            with self._idle_lock:
                if self._tls is None:  # once, at the first connection (shared by the threads)
                    self._tls = tls_context(self.ca_bundle)
            return http.client.HTTPSConnection(host, timeout=self.connect_timeout, context=self._tls), False
        return http.client.HTTPConnection(host, timeout=self.connect_timeout), False

    def _give_back(self, host: str, conn: http.client.HTTPConnection) -> None:
        with self._idle_lock:
            idle = self._idle.setdefault(host, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def _target(self, bucket: str, key: str | None) -> tuple[str, str]:
        if self.path_style:
            return self.netloc, _quote(f"/{bucket}/{key}" if key is not None else f"/{bucket}")
        return f"{bucket}.{self.netloc}", _quote(f"/{key}" if key is not None else "/")

    def _sign(
        self, method: str, host: str, path: str, query: str, payload_hash: str, extra: dict[str, str]
    ) -> dict[str, str]:
        now = dt.datetime.now(dt.UTC)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
        if self.credentials.session_token:
            headers["x-amz-security-token"] = self.credentials.session_token
        headers.update({k.lower(): v for k, v in extra.items()})
        signed = sorted(headers)
        canonical = "\n".join(
            [
                method,
                path,
                query,
                *(f"{name}:{headers[name].strip()}" for name in signed),
                "",
                ";".join(signed),
                payload_hash,
            ]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = _hmac(("AWS4" + self.credentials.secret_access_key).encode(), day)
        for part in (self.region, "s3", "aws4_request"):
            key = _hmac(key, part)
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.credentials.access_key_id}/{scope}, "
            f"SignedHeaders={';'.join(signed)}, Signature={signature}"
        )
        return headers

    def _request(
        self,
        method: str,
        bucket: str,
        key: str | None,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        payload_sha256: str | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        host, path = self._target(bucket, key)
        query = "&".join(
            f"{urllib.parse.quote(k, safe='~')}={urllib.parse.quote(v, safe='~')}"
            for k, v in sorted((params or {}).items())
        )
        payload_hash = payload_sha256 or (hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256)
        signed = self._sign(method, host, path, query, payload_hash, headers or {})
        if body or method in ("PUT", "POST"):
            signed["content-length"] = str(len(body))
        self.requests_made += 1  # not exact across threads: a figure, not a count anything relies on
        while True:
            conn, reused = self._take(host)
            try:
                if conn.sock is None:
                    conn.connect()
                    assert conn.sock is not None
                    conn.sock.settimeout(self.timeout)  # connect fast or fail; then wait for slow answers
                conn.request(method, f"{path}?{query}" if query else path, body=body or None, headers=signed)
                response = conn.getresponse()
                data = response.read()
            except (http.client.HTTPException, OSError) as exc:
                conn.close()
                # An idle connection the server closed meanwhile fails at once (reset, broken pipe, closed
                # without an answer): the request is made again on a new one. Not a timeout, and not a
                # POST (a multipart upload's start or end), which is not idempotent.
                if reused and isinstance(exc, ConnectionError) and method != "POST":
                    continue
                raise
            if response.will_close:
                conn.close()
            else:
                self._give_back(host, conn)
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    @staticmethod
    def _error(status: int, data: bytes) -> LiteS3Error:
        text = data.decode(errors="replace")
        code = re.search(r"<Code>([^<]+)</Code>", text)
        message = re.search(r"<Message>([^<]*)</Message>", text)
        return LiteS3Error(
            status, code.group(1) if code else str(status), message.group(1) if message else ""
        )

    def get(self, bucket: str, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        headers = {"range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        status, _, data = self._request("GET", bucket, key, headers=headers)
        if status not in (200, 206):
            raise self._error(status, data)
        return data

    def put(self, bucket: str, key: str, body: bytes, content_type: str = "application/octet-stream") -> None:
        status, _, data = self._request("PUT", bucket, key, body, {"content-type": content_type})
        if status != 200:
            raise self._error(status, data)

    def head(self, bucket: str, key: str) -> tuple[int, dt.datetime] | None:
        """The object's size and modification time, or None when it does not exist."""
        from email.utils import parsedate_to_datetime

        status, headers, data = self._request("HEAD", bucket, key)
        if status == 404:
            return None
        if status != 200:
            raise self._error(status, data)
        modified = headers.get("last-modified")
        when = parsedate_to_datetime(modified) if modified else dt.datetime.now(dt.UTC)
        return int(headers.get("content-length", "0")), when

    # -- bucket-level and multipart operations ---------------------------------------------------

    def head_bucket(self, bucket: str) -> None:
        status, _, data = self._request("HEAD", bucket, None)
        if status == 404:
            raise LiteS3Error(404, "NoSuchBucket", "no such bucket")
        if status != 200:
            raise self._error(status, data)

    def list_page(
        self, bucket: str, prefix: str, delimiter: str | None = None, token: str | None = None
    ) -> ListPage:
        params = {"list-type": "2", "prefix": prefix}
        if delimiter:
            params["delimiter"] = delimiter
        if token:
            params["continuation-token"] = token
        status, _, data = self._request("GET", bucket, None, params=params)
        if status != 200:
            raise self._error(status, data)
        root = ElementTree.fromstring(data)
        objects = [
            (
                _text(item, "Key"),
                int(_text(item, "Size") or 0),
                dt.datetime.fromisoformat(_text(item, "LastModified").replace("Z", "+00:00")),
            )
            for item in _children(root, "Contents")
        ]
        prefixes = [_text(item, "Prefix") for item in _children(root, "CommonPrefixes")]
        truncated = _text(root, "IsTruncated").lower() == "true"
        return ListPage(objects, prefixes, _text(root, "NextContinuationToken") if truncated else None)

    def delete_many(self, bucket: str, keys: list[str]) -> list[tuple[str, str, str]]:
        """Delete up to 1000 keys; returns (key, code, message) for those S3 refused to delete."""
        body = (
            "<Delete><Quiet>true</Quiet>"
            + "".join(f"<Object><Key>{escape(k)}</Key></Object>" for k in keys)
            + "</Delete>"
        ).encode()
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        status, _, data = self._request("POST", bucket, None, body, {"content-md5": md5}, {"delete": ""})
        if status != 200:
            raise self._error(status, data)
        root = ElementTree.fromstring(data) if data.strip() else None
        errors = _children(root, "Error") if root is not None else []
        return [(_text(e, "Key"), _text(e, "Code"), _text(e, "Message")) for e in errors]

    def create_multipart(self, bucket: str, key: str, content_type: str = "application/octet-stream") -> str:
        status, _, data = self._request(
            "POST", bucket, key, headers={"content-type": content_type}, params={"uploads": ""}
        )
        if status != 200:
            raise self._error(status, data)
        return _text(ElementTree.fromstring(data), "UploadId")

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, data: bytes, sha256: str | None = None
    ) -> str:
        params = {"partNumber": str(number), "uploadId": upload_id}
        status, headers, body = self._request("PUT", bucket, key, data, params=params, payload_sha256=sha256)
        if status != 200:
            raise self._error(status, body)
        return headers.get("etag", "")

    def complete_multipart(self, bucket: str, key: str, upload_id: str, etags: list[str]) -> None:
        body = (
            "<CompleteMultipartUpload>"
            + "".join(
                f"<Part><PartNumber>{i + 1}</PartNumber><ETag>{escape(etag)}</ETag></Part>"
                for i, etag in enumerate(etags)
            )
            + "</CompleteMultipartUpload>"
        ).encode()
        status, _, data = self._request("POST", bucket, key, body, params={"uploadId": upload_id})
        # S3 may answer 200 with an error document when the completion fails late
        if status != 200 or b"<Error>" in data:
            raise self._error(status if status != 200 else 500, data)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        status, _, data = self._request("DELETE", bucket, key, params={"uploadId": upload_id})
        if status not in (200, 204, 404):
            raise self._error(status, data)


@dataclass(frozen=True)
class ListPage:
    objects: list[tuple[str, int, dt.datetime]]
    prefixes: list[str]
    next_token: str | None


def _children(root: ElementTree.Element, tag: str) -> list[ElementTree.Element]:
    return [child for child in root if child.tag.rsplit("}", 1)[-1] == tag]


def _text(root: ElementTree.Element, tag: str) -> str:
    for child in root:
        if child.tag.rsplit("}", 1)[-1] == tag:
            return child.text or ""
    return ""
