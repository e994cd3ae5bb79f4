"""Hub ids without a network: served from the local Hugging Face cache, or refused at once.

huggingface_hub retries an unreachable hub for about 50 seconds before it gives up (and prints every
retry); a job on an offline machine should learn in a second that the model is not there. So before
a hub id is loaded, a short connection to the hub (or to the HTTPS proxy) tells whether there is a
network; without one the cache alone is read (``local_files_only``).
"""

from __future__ import annotations

import functools
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants, try_to_load_from_cache

PROBE_TIMEOUT_S = 3.0  # a reachable hub answers a TCP connect in well under this


class HubUnavailable(ValueError):
    """A hub id that cannot be loaded here: no network and no cached copy (the message is one line)."""


def local_only(name: str) -> bool:
    """Whether model ``name`` must be read from the local cache alone: a hub id (``org/name``, not a
    path, not a GGUF file) with no network to fetch it. Raises `HubUnavailable` when the cache has no copy either."""
    if Path(name).expanduser().exists() or name.lower().endswith(".gguf"):
        return False
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path (the loader says it is missing)
        return False
    reason = offline_reason()
    if reason is None:
        return False
    if not in_cache(name):
        raise HubUnavailable(
            f"cannot load model {name!r}: no network ({reason}) and no local copy in the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE})"
        )
    return True


@functools.cache  # once per process: the command line asks before loading, the loader again
def offline_reason() -> str | None:
    """Why the hub cannot be reached ("HF_HUB_OFFLINE is set", "cannot reach huggingface.co: ..."), or
    None when a connection to it (or to the configured HTTPS proxy) opens."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(urllib.request.getproxies().get("https") or constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    failure: list[OSError] = []
    done = threading.Event()

    def probe() -> None:  # in a thread: a name lookup can hang past any socket timeout
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as e:
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=probe, daemon=True).start()
    if not done.wait(PROBE_TIMEOUT_S + 1):
        return f"{host} did not answer within {PROBE_TIMEOUT_S:.0f} s"
    if failure:
        return f"cannot reach {host}: {failure[0].strerror or failure[0]}"
    return None


def in_cache(repo_id: str) -> bool:
    """The local cache holds a copy of ``repo_id`` (its config.json)."""
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: from_pretrained will say why
        return False
