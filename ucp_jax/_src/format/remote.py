"""Object stores: kvstore specs from URLs, JSON text or dicts, completed from the standard AWS and
GCS configuration, with bounded retries and deadlines.

TensorStore's `s3` driver reads credentials itself (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
`AWS_SESSION_TOKEN`, `~/.aws/credentials` with `AWS_PROFILE`, the instance metadata service) but
not the endpoint or region settings boto3 reads: `complete` adds those (`AWS_ENDPOINT_URL_S3`,
`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_DEFAULT_REGION`, `~/.aws/config`). Its `gcs` driver takes
its endpoint from `TENSORSTORE_GCS_HTTP_URL` only: `complete` sets it from `STORAGE_EMULATOR_HOST`
(what Google's own clients read) when unset. Every remote spec gets bounded request retries, and
the first contact with a store waits at most `UCP_STORE_TIMEOUT_S`: an unreachable store is a
`StoreUnreachableError` naming the URL, not a hang.
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, NoReturn

from ..errors import StoreError, StoreUnreachableError, UcpError
from ..util import config

REMOTE_DRIVERS = frozenset({"s3", "gcs", "gcs_grpc", "http"})
_RETRIES = {
    "s3": "s3_request_retries",
    "gcs": "gcs_request_retries",
    "gcs_grpc": "gcs_request_retries",
}
# Words of TensorStore errors that mean the store never answered (no connection, no reply).
_UNREACHABLE = (
    "CURL error",
    "retry attempts failed",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "Could not resolve",
    "Could not connect",
)
# ... and words of errors that mean it answered with a refusal (bucket, permissions, credentials).
_REFUSED = (
    "NoSuchBucket",
    "AccessDenied",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidBucketName",
)
_probed: set[str] = set()
_probe_lock = threading.Lock()


def spec_of(path: Any) -> dict[str, Any] | None:
    """The kvstore spec of a dict, of a `Location`-like object (`.kvstore`) or of JSON text.

    None for anything else (a local path or a URL, which `Location.parse` handles).

    >>> spec_of('{"driver": "memory", "path": "a/"}')
    {'driver': 'memory', 'path': 'a/'}
    >>> spec_of("/tmp/ckpt") is None
    True
    """
    if isinstance(path, dict):
        return copy.deepcopy(path)
    kv = getattr(path, "kvstore", None)
    if isinstance(kv, dict):
        return copy.deepcopy(kv)
    if isinstance(path, str) and path.lstrip().startswith("{"):
        try:
            spec = json.loads(path)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path[:200]!r} starts with '{{' but is not JSON ({e}); give a TensorStore "
                'kvstore spec such as {"driver": "s3", "bucket": "b", "path": "run/step_1"}'
            ) from None
        if not isinstance(spec, dict):
            raise ValueError(f"{path[:200]!r}: a kvstore spec must be a JSON object")
        return spec
    return None


def bytes_store(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec of the store that holds the bytes: an adapter's (OCDBT's) `base`, followed down.

    >>> bytes_store({"driver": "ocdbt", "base": {"driver": "s3", "bucket": "b"}})["driver"]
    's3'
    """
    while isinstance(spec.get("base"), dict):
        spec = spec["base"]
    return spec


def is_remote(spec: dict[str, Any]) -> bool:
    """Whether a kvstore spec reaches a store over the network (s3, gcs, http).

    >>> is_remote({"driver": "s3", "bucket": "b"}), is_remote({"driver": "file", "path": "/x"})
    (True, False)
    >>> is_remote({"driver": "ocdbt", "base": {"driver": "s3", "bucket": "b"}})
    True
    """
    return bytes_store(spec).get("driver") in REMOTE_DRIVERS


def complete(spec: dict[str, Any]) -> dict[str, Any]:
    """Fill in what TensorStore does not read from the environment itself (in place; returned).

    s3: `endpoint` (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, then `~/.aws/config`, unless
    `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`) and, with an endpoint, `aws_region` (`AWS_REGION`,
    `AWS_DEFAULT_REGION`, then `~/.aws/config`; on AWS itself TensorStore looks up the bucket's
    region), and `aws_credentials` from the environment when `AWS_ACCESS_KEY_ID` and
    `AWS_SECRET_ACCESS_KEY` are set (what the default chain would pick first). gcs:
    `TENSORSTORE_GCS_HTTP_URL` from
    `STORAGE_EMULATOR_HOST`. Remote drivers: bounded request retries (`UCP_STORE_RETRIES`).
    Whatever the spec already says is kept.

    >>> complete({"driver": "s3", "bucket": "b", "endpoint": "http://127.0.0.1:9000"})["endpoint"]
    'http://127.0.0.1:9000'
    """
    driver = spec.get("driver")
    if driver == "s3":
        profile = _aws_profile()
        if "endpoint" not in spec:
            endpoint = _aws_endpoint(profile)
            if endpoint:
                spec["endpoint"] = endpoint
        # Keys in the environment come first in the AWS credential chain anyway; naming that
        # source skips the chain's profile-file reader, which logged five error lines for every
        # kvstore opened on a host without ~/.aws/config (11 times a save, 3 a restore here).
        if ("aws_credentials" not in spec and os.environ.get("AWS_ACCESS_KEY_ID")
                and os.environ.get("AWS_SECRET_ACCESS_KEY")):  # fmt: skip
            spec["aws_credentials"] = {"type": "environment"}
        # On AWS itself TensorStore finds each bucket's region (a wrong one would not redirect, as
        # boto3 does); another endpoint needs the region to sign with.
        if "aws_region" not in spec and "endpoint" in spec:
            region = (
                os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or profile.get("region")
            )
            if region:
                spec["aws_region"] = region
    elif driver == "gcs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        if emulator and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
            if "://" not in emulator:
                emulator = "http://" + emulator
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = emulator.rstrip("/")
    retries = _RETRIES.get(str(driver))
    if retries and retries not in spec:
        spec[retries] = retry_policy()
    if is_remote(spec):
        _bound_stalls()
    return spec


def retry_policy() -> dict[str, Any]:
    """TensorStore's retry resource for one request: `UCP_STORE_RETRIES` attempts, backing off
    from 0.5 s to a quarter of `UCP_STORE_TIMEOUT_S` (at most 32 s).

    >>> retry_policy()["initial_delay"]
    '0.5s'
    """
    cap = min(max(config.store_timeout_s() / 4, 0.5), 32.0)
    return {
        "max_retries": config.store_retries(),
        "initial_delay": "0.5s",
        "max_delay": f"{cap:g}s",
    }


def _bound_stalls() -> None:
    """A connection that accepts but stops sending fails after `UCP_STORE_TIMEOUT_S` (then is
    retried) instead of hanging: TensorStore's curl low-speed limit, unless already set.

    TensorStore reads these once, when it makes its HTTP transport (the first remote request).
    """
    stall = max(int(config.store_timeout_s()), 1)
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(stall))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


def _aws_profile() -> dict[str, str]:
    """The settings of the active profile in the AWS config file (`AWS_CONFIG_FILE`, `AWS_PROFILE`).

    Includes the `s3` endpoint of its `services` section, as `s3_endpoint_url`.
    """
    path = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    if not os.path.isfile(path):
        return {}
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return {}
    name = os.environ.get("AWS_PROFILE") or "default"
    section = name if name == "default" and parser.has_section(name) else f"profile {name}"
    if not parser.has_section(section):
        return {}
    out = dict(parser.items(section))
    services = out.get("services")
    if services and parser.has_section(f"services {services}"):
        nested = _nested(parser.get(f"services {services}", "s3", fallback=""))
        if "endpoint_url" in nested:
            out["s3_endpoint_url"] = nested["endpoint_url"]
    return out


def _nested(text: str) -> dict[str, str]:
    """The `key = value` lines of a nested AWS config block (e.g. `s3 =` then indented lines)."""
    out = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq:
            out[key.strip()] = value.strip()
    return out


def _aws_endpoint(profile: dict[str, str]) -> str | None:
    """The S3 endpoint boto3 would use, or None for AWS's own."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or profile.get("s3_endpoint_url")
        or profile.get("endpoint_url")
        or None
    )


def url_of(spec: dict[str, Any]) -> str:
    """The URL of the folder a spec names (an OCDBT database: the folder it lives in); a local
    folder as its path.

    >>> url_of({"driver": "ocdbt", "base": {"driver": "gcs", "bucket": "b", "path": "run/"}})
    'gs://b/run'
    >>> url_of({"driver": "file", "path": "/ck/step_1/"})
    '/ck/step_1'
    """
    spec = bytes_store(spec)
    if spec.get("driver") == "file":
        return str(spec.get("path", "")).rstrip("/")
    scheme = {"gcs": "gs", "gcs_grpc": "gs"}.get(spec.get("driver", ""), spec.get("driver", ""))
    bucket = spec.get("bucket", "")
    path = url_quote(spec.get("path", "").rstrip("/"))
    return f"{scheme}://{bucket}{'/' if bucket else ''}{path}"


def url_quote(path: str) -> str:
    """A path as a kvstore URL must spell it: TensorStore decodes ``%XX`` and refuses ``?`` and
    ``#``, so those three are encoded (the URL then opens the same path; nothing else changes).

    >>> url_quote("run/x%41?#")
    'run/x%2541%3F%23'
    """
    return path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def describe(spec: dict[str, Any]) -> str:
    """The store's URL for messages, with its endpoint when it has one.

    >>> describe({"driver": "s3", "bucket": "b", "path": "run/", "endpoint": "http://h:9"})
    's3://b/run (endpoint http://h:9)'
    """
    url, spec = url_of(spec), bytes_store(spec)
    if spec.get("driver") == "gcs" and os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        return f"{url} (endpoint {os.environ['TENSORSTORE_GCS_HTTP_URL']})"
    if spec.get("endpoint"):
        return f"{url} (endpoint {spec['endpoint']})"
    return url


def unreachable(spec: dict[str, Any], what: str, cause: str) -> StoreUnreachableError:
    """The error for a store that did not answer `what`."""
    hint = (
        "check the endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, or 'endpoint' in the spec), "
        "the network and the credentials"
        if spec.get("driver") == "s3"
        else "check the endpoint (STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL), the network "
        "and the credentials"
        if spec.get("driver") in ("gcs", "gcs_grpc")
        else "check the URL and the network"
    )
    slow = ("" if cause.startswith("connection refused") else
            f", or raise UCP_STORE_TIMEOUT_S (now {config.store_timeout_s():g} s) if it is only "
            "slow")  # fmt: skip
    return StoreUnreachableError(
        f"{describe(spec)}: the store did not answer {what} ({cause}); {hint}{slow}"
    )


def refused(spec: dict[str, Any], what: str, cause: str) -> StoreError:
    """The error for a store that answered `what` with a refusal."""
    return StoreError(
        f"{describe(spec)}: the store refused {what} ({cause}); check the bucket name, that it "
        "exists, and the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS)"
    )


def looks_unreachable(e: BaseException) -> bool:
    """Whether a TensorStore error means no connection or no answer (not a missing key)."""
    msg = str(e)
    return any(w in msg for w in _UNREACHABLE)


def translate(
    e: BaseException, spec: dict[str, Any], what: str, *, writing: bool = False
) -> BaseException:
    """A TensorStore error of a remote store's request as a StoreUnreachableError when it means
    the store stopped answering (after its retries), as a StoreError when it refused (bucket,
    permissions, credentials); any other error as it is.

    `writing`: the requests were a save's. A key a save reads may be missing (TensorStore says
    so without an error), so a 404 there means no bucket: GCS answers a write to a bucket that
    does not exist with a bare 404, where S3 says NoSuchBucket.

    >>> type(translate(ValueError("CURL error Could not connect"), {"driver": "s3"}, "x")).__name__
    'StoreUnreachableError'
    >>> nf = ValueError("NOT_FOUND: Not Found [http_response_code='404']")
    >>> type(translate(nf, {"driver": "gcs", "bucket": "b"}, "x", writing=True)).__name__
    'StoreError'
    """
    if not (is_remote(spec) and isinstance(e, ValueError | NotImplementedError)) or isinstance(
        e, UcpError
    ):
        return e
    text = str(e)
    if any(w in text for w in _REFUSED):
        out: StoreError = refused(spec, what, text[:300])
    elif writing and "http_response_code='404'" in text:
        out = refused(spec, what, f"404 Not Found: no such bucket; {text[:200]}")
    elif "<html" in text.lower() or "<!doctype" in text.lower():  # a web server, not a store
        out = StoreError(
            f"{describe(spec)}: {what} was answered with a web page, not by an object store "
            f"({text[:160]}); check the endpoint (AWS_ENDPOINT_URL_S3, the spec's 'endpoint')"
        )
    elif looks_unreachable(e):
        out = unreachable(spec, what, str(e)[:300])
    else:
        return e
    out.__cause__ = e
    return out


def raise_translated(
    e: BaseException, spec: dict[str, Any], what: str, *, writing: bool = False
) -> NoReturn:
    """Raise what `translate` makes of `e` (from `e`), or `e` itself when it is no store's error.

    Raises:
        StoreUnreachableError: the store stopped answering.
        StoreError: the store refused.
    """
    err = translate(e, spec, what, writing=writing)
    if err is e:
        raise e
    raise err from e


def wait(future: Any, spec: dict[str, Any], what: str) -> Any:
    """`future.result()` within `UCP_STORE_TIMEOUT_S`, for one small request to a remote store.

    Raises:
        StoreUnreachableError: no answer in time, or the connection failed after its retries.
        StoreError: the store refused (no such bucket, access denied, bad credentials).
    """
    timeout = config.store_timeout_s()
    deadline = time.monotonic() + timeout
    endpoint = _endpoint(spec)
    try:
        if endpoint is not None:  # no answer in a second: is anything listening there?
            try:
                return future.result(timeout=min(REFUSED_CHECK_S, timeout))
            except TimeoutError:
                if (why := connection_refused(endpoint)) is not None:
                    future.cancel()
                    raise unreachable(spec, what, why) from None
        return future.result(timeout=max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        future.cancel()
        raise unreachable(spec, what, f"no answer within {timeout:g} s") from None
    except (ValueError, NotImplementedError) as e:
        raise_translated(e, spec, what)


REFUSED_CHECK_S = 1.0  # a first request unanswered this long: the endpoint's port is tried


def _endpoint(spec: dict[str, Any]) -> str | None:
    """The URL of a store's own endpoint (an S3-compatible server, a GCS emulator), or None for
    the cloud's (whose address is no one port to try)."""
    spec = bytes_store(spec)
    if spec.get("driver") == "s3":
        return spec.get("endpoint") or None
    if spec.get("driver") in ("gcs", "gcs_grpc"):
        return os.environ.get("TENSORSTORE_GCS_HTTP_URL") or None
    return None


def connection_refused(url: str) -> str | None:
    """Why nothing answers at `url`'s host and port ("connection refused at ..."), or None when
    a connection is made, or its failure says nothing certain (a timeout, a name not found).

    >>> connection_refused("http://127.0.0.1:9")  # (the discard port: nothing listens)
    'connection refused at 127.0.0.1:9 (nothing listens there)'
    """
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = parts.hostname
    if not host:
        return None
    try:
        socket.create_connection((host, port), timeout=REFUSED_CHECK_S).close()
    except ConnectionRefusedError:
        return f"connection refused at {host}:{port} (nothing listens there)"
    except OSError:
        return None
    return None


def probe(kv: Any, spec: dict[str, Any]) -> None:
    """Once per store (driver, bucket, endpoint) and process: one small read within the deadline.

    Later requests (array writes, listings) run without a deadline of their own, bounded by the
    retry policy; this first one makes an unreachable store fail fast and clearly.
    """
    spec = bytes_store(spec)
    endpoint = spec.get("endpoint")
    if spec.get("driver") == "gcs":
        endpoint = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
    key = json.dumps([spec.get("driver"), spec.get("bucket"), endpoint, spec.get("host_header")])
    with _probe_lock:
        if key in _probed:
            return
    wait(kv.read(".ucp-probe"), spec, "a first read")
    with _probe_lock:
        _probed.add(key)
