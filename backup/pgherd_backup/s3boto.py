"""The boto3 backend: the same operations as `s3lite.LiteS3`, for what the small client does not
cover (credentials from instance profiles, web identity, SSO...). Imported only when needed."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pgherd_backup.s3lite import ListPage


class BotoS3:
    def __init__(self, client: Any) -> None:
        self.client = client

    def head_bucket(self, bucket: str) -> None:
        try:
            self.client.head_bucket(Bucket=bucket)
        except Exception as exc:
            status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                from botocore.exceptions import ClientError

                raise ClientError(
                    {"Error": {"Code": "NoSuchBucket", "Message": "no such bucket"}}, "HeadBucket"
                ) from exc
            raise

    def get(self, bucket: str, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if byte_range is not None:
            args["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        body = self.client.get_object(**args)["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def put(self, bucket: str, key: str, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)

    def head(self, bucket: str, key: str) -> tuple[int, dt.datetime] | None:
        try:
            r = self.client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            if getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise
        return int(r["ContentLength"]), r["LastModified"]

    def list_page(
        self, bucket: str, prefix: str, delimiter: str | None = None, token: str | None = None
    ) -> ListPage:
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            args["Delimiter"] = delimiter
        if token:
            args["ContinuationToken"] = token
        page = self.client.list_objects_v2(**args)
        return ListPage(
            [(o["Key"], int(o["Size"]), o["LastModified"]) for o in page.get("Contents", [])],
            [p["Prefix"] for p in page.get("CommonPrefixes", [])],
            page.get("NextContinuationToken") if page.get("IsTruncated") else None,
        )

    def delete_many(self, bucket: str, keys: list[str]) -> list[tuple[str, str, str]]:
        r = self.client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
        )
        return [(e.get("Key", ""), e.get("Code", ""), e.get("Message", "")) for e in r.get("Errors") or []]

    def create_multipart(self, bucket: str, key: str, content_type: str = "application/octet-stream") -> str:
        return str(
            self.client.create_multipart_upload(Bucket=bucket, Key=key, ContentType=content_type)["UploadId"]
        )

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, data: bytes, sha256: str | None = None
    ) -> str:
        r = self.client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
        return str(r["ETag"])

    def complete_multipart(self, bucket: str, key: str, upload_id: str, etags: list[str]) -> None:
        parts = [{"ETag": etag, "PartNumber": i + 1} for i, etag in enumerate(etags)]
        self.client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
