"""One request to a model server before any episode: a dead or mistyped URL fails in one line.

Without it every episode retries for seconds, ends as `backend_error` and scores 0: a dead port
looked like a model that scores nothing. `check_server` asks the OpenAI route every compatible
server has (`GET <base_url>/models`: vLLM, SGLang, llama.cpp, OpenAI itself) once, without
retries, through the backend's own client (its key, its limits).
"""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0
_MAX_READ = 1 << 20  # a model list longer than this is not read to the end


class ServerCheckError(RuntimeError):
    """The server did not answer the check; the message names the URL (without credentials) and why."""


def public_url(url: str) -> str:
    """A server URL fit to print and write: scheme, host, port and path; no user:password, query or
    fragment, where credentials sometimes travel."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number: shown as typed would echo whatever follows
        port = ":?"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def check_server(backend: Any, *, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """`GET <backend.base_url>/models` once; ServerCheckError unless the server answers 200.

    A reply that lists models but not `backend.model` is a warning only: some APIs serve aliases
    they do not list.
    """
    url = public_url(backend.base_url)
    try:
        with backend._client.stream("GET", backend.base_url + "/models", timeout=timeout_s) as response:
            status = response.status_code
            body = bytearray()
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > _MAX_READ:
                    break
    except httpx.TimeoutException:
        raise ServerCheckError(f"model server {url} did not answer within {timeout_s:g} s") from None
    except (httpx.TransportError, httpx.InvalidURL, ValueError) as error:
        reason = " ".join(str(error).replace(backend.base_url, url).split())[:200] or type(error).__name__
        raise ServerCheckError(f"model server {url} cannot be reached: {type(error).__name__}: {reason}") from None
    if status in (401, 403):
        raise ServerCheckError(f"model server {url} refused the API key (HTTP {status}); set the variable the "
                               "key is read from (--api-key-env, default OPENAI_API_KEY)")
    if status == 404:
        raise ServerCheckError(f"model server {url} has no {urlsplit(backend.base_url).path.rstrip('/')}/models "
                               "route (HTTP 404): is the URL's path right? An OpenAI-compatible server's URL "
                               "usually ends in /v1")
    if status != 200:
        raise ServerCheckError(f"model server {url} answered GET /models with HTTP {status}")
    try:
        listed = [str(m.get("id")) for m in json.loads(bytes(body)).get("data", []) if isinstance(m, dict)]
    except (ValueError, AttributeError, TypeError, RecursionError):
        return  # answered, in a shape of its own: the requests will tell
    if listed and backend.model not in listed:
        # A server may list the key it was sent as a model name: redacted before the cut.
        redact = getattr(backend, "redact", lambda text: text)
        shown = ", ".join(repr(redact(name)[:80]) for name in listed[:8]) + (" ..." if len(listed) > 8 else "")
        logger.warning("model server %s does not list the model %r (it lists %s); requests may fail",
                       url, backend.model[:80], shown)
