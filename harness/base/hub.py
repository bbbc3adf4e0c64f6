"""Whether the Hugging Face hub can be reached from this process."""

from __future__ import annotations

import functools


@functools.cache
def hub_reachable() -> bool:
    """Whether the HF hub answers, asked once per process. Never in huggingface_hub's offline mode
    (HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE, as it reads them); otherwise one HEAD request to its
    endpoint (HF_ENDPOINT) through its own HTTP client, so with the proxies and certificates its
    downloads use, within its metadata timeout (HF_HUB_ETAG_TIMEOUT, 10 s by default; the downloads
    themselves take HF_HUB_DOWNLOAD_TIMEOUT). Unreachable: models and tokenizers load from the cache alone."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import httpx

    if constants.is_offline_mode():
        return False
    # huggingface_hub cannot make this call itself: a file it holds it takes from the cache after one failed request,
    # but for a file it lacks it asks again with backoff (six more requests, each with a fixed 60 s timeout that no
    # setting changes, 23 s of waits between them), so an unreachable hub would cost half a minute or more per load.
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (httpx.TransportError, OfflineModeIsEnabled):  # refused, timed out, no route, proxy down
        return False
    return True  # any answer, an error status included: the hub (or its proxy) is there
