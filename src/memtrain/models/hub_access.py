"""Whether the Hugging Face Hub can be reached now, so an offline ``hf:ORG/NAME`` fails in seconds.

Without this, an unreachable Hub costs about half a minute per file: huggingface_hub retries a
failed request five times with growing back-off before transformers gives up. Two cases it misses:

* ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) set after huggingface_hub was imported
  (in a notebook, a test, a wrapper script): the library reads the variable once, at import.
* no network at all: a name that does not resolve is retried like a server error.

In both cases memtrain passes ``local_files_only=True`` (the library's own switch), so a model
already in the local cache still loads and an absent one fails at once.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any, Optional
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 3.0
_TRUE = {"1", "on", "yes", "true"}
# With a proxy the Hub may be reachable while a direct connection is not: then only the
# library itself can tell, so memtrain does not probe.
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")


def offline_reason() -> Optional[str]:
    """Why the Hub is not to be asked now (None when it may be): offline mode set in the
    environment, or the Hub's host refusing a direct connection."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    return _unreachable(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT)


@functools.lru_cache(maxsize=4)
def _unreachable(endpoint: str) -> Optional[str]:
    """A direct TCP connection to the endpoint, once per process: None when it opens, else why not."""
    url = urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host} is unreachable ({exc.strerror or type(exc).__name__})"


def from_pretrained_kwargs(repo: Optional[str]) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for a model read from ``repo`` (None: a local path)."""
    if repo is None or offline_reason() is None:
        return {}
    return {"local_files_only": True}


def offline_hint(repo: Optional[str]) -> str:
    """What to add to a failed Hub read's error: why the Hub was not asked and what to do."""
    reason = offline_reason() if repo is not None else None
    if reason is None:
        return ""
    return (f" (the Hub was not asked: {reason}; {repo} is not in the local Hugging Face cache: "
            "connect once to download it, or point --model at a local directory)")
