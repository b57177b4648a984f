"""timm's pretrained weights without a long wait: from the local cache first, with the Hub in its own offline
mode; then from the network only when a quick probe reaches it.

Without a network, timm's download through huggingface_hub retried for 52 s and printed 22 lines of retries
before its error. The cache is read with huggingface_hub's offline mode
(`huggingface_hub.constants.HF_HUB_OFFLINE`, the setting `HF_HUB_OFFLINE=1` makes), and a TCP connection
to the host the weights come from (or to the proxy in the environment) says whether a download can start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import timm.models
from huggingface_hub import constants

PROBE_SECONDS = 3.0
"""How long the probe waits for a connection to the weights' host: a reachable host answers in well under a
second; an unreachable network is refused at once or times out here."""

Built = TypeVar("Built")


class Unreachable(ConnectionError):
    """The weights are not in the local cache and their host cannot be reached (an OSError: `create`'s
    `_pretrained_problem` words it as a failed download)."""


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """huggingface_hub's offline mode for the block: files come from its cache or not at all, at once."""
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


@contextlib.contextmanager
def quiet_hub() -> Iterator[None]:
    """No retry warnings from huggingface_hub while the block runs: a failure is reported once, by moespec."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def weights_host(model: str) -> str:
    """The URL the pretrained weights of timm's `model` come from: the Hub (its endpoint, `HF_ENDPOINT`) for a
    `hf_hub_id`, else the config's `url`."""
    try:
        cfg = timm.models.get_pretrained_cfg(model)
    except (RuntimeError, KeyError, ValueError):  # no pretrained config of that name: the Hub is asked
        cfg = None
    if cfg is not None and not cfg.hf_hub_id and cfg.url:
        return cfg.url
    return constants.ENDPOINT


def probe(url: str, timeout: float = PROBE_SECONDS) -> str | None:
    """None when a TCP connection to `url`'s host (or to the HTTPS proxy of the environment) opens within
    `timeout` seconds; else why not, in a few words."""
    proxy = next((os.environ[name] for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(name)), None)
    parts = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as error:
        return f"cannot reach {host}:{port}{' (the proxy)' if proxy else ''}: {error.strerror or error}"


def create_pretrained(create: Callable[[], Built], model: str) -> Built:
    """`create()` (timm's create_model with pretrained=True) from the local cache when the weights are there;
    else from the network when it is reachable, and an `Unreachable` error at once when it is not, with no
    retries and none of their log lines."""
    try:
        with hub_offline(), quiet_hub():
            return create()
    except OSError:  # not in the cache (huggingface_hub's LocalEntryNotFoundError, OfflineModeIsEnabled)
        if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: the user asked for the cache only
            raise
    url = weights_host(model)
    problem = probe(url)
    if problem is not None:
        raise Unreachable(f"not in the local cache, and {problem}")
    with quiet_hub():
        return create()
