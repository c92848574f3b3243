"""A landing zone on object storage (S3 and S3-compatible stores): the zone's URL, and the few calls it needs.

Object stores have no rename: the writer puts data files under final unique names, then the manifest with a
conditional create (``If-None-Match: *``), which is the one step that makes a batch visible
(docs/landing-format.md, "On object storage"). boto3, not ``pyarrow.fs``: Arrow's S3 file system cannot send
that header.

Errors: credentials or permissions refused, or a missing bucket, are ``SinkFatal`` (no retry cures them, the
message names the bucket and the setting); anything else (connection refused or cut, timeouts, 5xx) is a
``SinkError`` the caller retries.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from cdcd.errors import SinkError, SinkFatal

T = TypeVar("T")

SCHEMES = ("s3://", "s3a://")
#: What ``pathlib`` makes of an ``s3://`` URL (one slash): a zone URL that passed through a ``Path`` is still one.
_MANGLED = ("s3:/", "s3a:/")
#: Error codes that mean "who you are, or what you may do, is refused": retrying cannot help.
_REFUSED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidClientTokenId", "ExpiredToken",
            "InvalidToken", "AuthorizationHeaderMalformed", "XAdminUserNotFound"}
CREDENTIALS_HINT = ("landing.s3.access_key_id and landing.s3.secret_access_key_file, or the environment "
                    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) or the AWS credentials file")
TARGET_CREDENTIALS_HINT = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, or the "
                           "AWS credentials file")


def is_object_url(path: str | Path) -> bool:
    """Whether a landing path names object storage (``s3://bucket/prefix``, ``s3a://...``)."""
    text = str(path)
    return text.startswith(SCHEMES) or (isinstance(path, Path) and text.startswith(_MANGLED))


def zone_name(path: str | Path) -> str:
    """How a landing zone is named to the operator: its ``s3://`` URL, or the directory."""
    return Location.parse(path).url if is_object_url(path) else str(path)


@dataclass(frozen=True, slots=True)
class Location:
    """A bucket and a key prefix (no leading or trailing slash; empty for the bucket's root)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, path: str | Path) -> Location:
        text = str(path)
        scheme = next((s for s in (*SCHEMES, *_MANGLED) if text.startswith(s)), None)
        if scheme is None:
            raise SinkFatal(f"landing zone {text} is not an object-store URL; write s3://bucket/prefix")
        bucket, _, prefix = text[len(scheme):].partition("/")
        if not bucket:
            raise SinkFatal(f"landing zone {text}: no bucket; write s3://bucket/prefix (landing.path)")
        return cls(bucket, prefix.strip("/"))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative


@dataclass(frozen=True, slots=True)
class Settings:
    """How to reach the store. Unset credentials: boto3's usual chain (environment, AWS credentials file, roles);
    unset endpoint and region: AWS_ENDPOINT_URL(_S3) and AWS_REGION, else AWS itself."""

    endpoint: str | None = None
    region: str | None = None
    path_style: bool = True
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Entry:
    """An object under a directory-like prefix: its name after the prefix, its last-modified time (epoch s)."""

    name: str
    modified: float


class ObjectStore:
    """The landing zone's calls to one bucket and prefix, each bounded by ``Settings.timeout_s``."""

    def __init__(self, location: Location, settings: Settings | None = None, role: str = "landing zone") -> None:
        s = settings or Settings()
        self.location = location
        self.role = role  # what the store holds, for the error messages (the Spark consumer's target too)
        landing = role == "landing zone"  # else the consumer's: its settings are its environment
        self.credentials_hint = CREDENTIALS_HINT if landing else TARGET_CREDENTIALS_HINT
        self.endpoint_hint = "landing.path or landing.s3.endpoint" if landing else "the URL or AWS_ENDPOINT_URL"
        self.settings = s
        # boto3 retries once on its own (a dropped keep-alive connection); the landing's backoff does the rest
        config = BotoConfig(connect_timeout=s.timeout_s, read_timeout=s.timeout_s,
                            retries={"max_attempts": 2, "mode": "standard"},
                            s3={"addressing_style": "path" if s.path_style else "auto"})
        self.client: Any = boto3.session.Session().client(
            "s3", endpoint_url=s.endpoint or None, region_name=s.region or os.environ.get("AWS_REGION") or None,
            aws_access_key_id=s.access_key_id, aws_secret_access_key=s.secret_access_key, config=config)

    def _call(self, what: str, relative: str, fn: Callable[[], T]) -> T:
        where = f"s3://{self.location.bucket}/{self.location.key(relative)}"
        try:
            return fn()
        except botocore.exceptions.NoCredentialsError as exc:
            raise SinkFatal(f"{self.role} {self.location.url}: no credentials for bucket {self.location.bucket} "
                            f"({what} {where}); set {self.credentials_hint}") from exc
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code in _REFUSED or status == 403:
                raise SinkFatal(
                    f"{self.role} {self.location.url}: the store refused the credentials for bucket "
                    f"{self.location.bucket} ({what} {where}: {code or status}); check {self.credentials_hint}, "
                    "and that they may read, write, list and delete in the bucket") from exc
            if code == "NoSuchBucket":
                raise SinkFatal(f"{self.role} {self.location.url}: bucket {self.location.bucket} does not exist "
                                f"at {self.settings.endpoint or 'AWS'}; create it, or fix "
                                f"{self.endpoint_hint}") from exc
            raise SinkError(f"{self.role} {self.location.url}: {what} {where} failed: {code or status} "
                            f"({exc.response.get('Error', {}).get('Message', '')})") from exc
        except botocore.exceptions.BotoCoreError as exc:  # unreachable, cut, timed out
            raise SinkError(f"{self.role} {self.location.url}: {what} {where} failed: {exc}; is the store at "
                            f"{self.settings.endpoint or 'AWS'} reachable ({self.endpoint_hint})?") from exc

    def put(self, relative: str, data: bytes) -> None:
        key = self.location.key(relative)
        self._call("PUT", relative, lambda: self.client.put_object(Bucket=self.location.bucket, Key=key, Body=data))

    def create(self, relative: str, data: bytes) -> bool:
        """PUT only if no object has the key (``If-None-Match: *``); False when one has."""
        key = self.location.key(relative)

        def put() -> bool:
            try:
                self.client.put_object(Bucket=self.location.bucket, Key=key, Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                    return False  # it exists (409, a concurrent conditional PUT in progress, is retried)
                raise
            return True

        return self._call("conditional PUT", relative, put)

    def get(self, relative: str) -> bytes | None:
        """The object's bytes; None when there is none."""
        key = self.location.key(relative)

        def get() -> bytes | None:
            try:
                body = self.client.get_object(Bucket=self.location.bucket, Key=key)["Body"]
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._call("GET", relative, get)

    def listdir(self, directory: str) -> list[Entry]:
        """The objects directly under ``directory`` (a relative prefix such as ``manifests``)."""
        prefix = self.location.key(directory) + "/"

        def list_all() -> list[Entry]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket,
                                                                           Prefix=prefix)
            return [Entry(o["Key"][len(prefix):], o["LastModified"].timestamp())
                    for page in pages for o in page.get("Contents", ()) if "/" not in o["Key"][len(prefix):]]

        return self._call("LIST", directory + "/", list_all)

    def delete(self, relatives: Iterable[str]) -> None:
        """Delete the objects (absent ones are no error), up to 1,000 a request."""
        names = list(relatives)
        keys = [self.location.key(r) for r in names]
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[start:start + 1000]]

            def delete(objects: list[dict[str, str]] = chunk) -> Any:
                return self.client.delete_objects(Bucket=self.location.bucket,
                                                  Delete={"Objects": objects, "Quiet": True})

            # DeleteObjects reports failures per key instead of raising: they are raised here
            done = self._call("DELETE", names[start], delete)
            if done.get("Errors"):
                first = done["Errors"][0]
                raise SinkError(f"{self.role} {self.location.url}: deleting {first.get('Key')} failed: "
                                f"{first.get('Code')} {first.get('Message', '')} ({len(done['Errors'])} keys)")
