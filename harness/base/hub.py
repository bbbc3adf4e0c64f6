"""Whether the Hugging Face hub can be reached from this process."""

from __future__ import annotations

import functools


@functools.cache
def hub_reachable() -> bool:
    """Whether the HF hub answers, asked once per process: never in huggingface_hub's offline mode, otherwise
    one HEAD request to its endpoint through its own client, within HF_HUB_ETAG_TIMEOUT. Unreachable: loads
    come from the cache alone."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import httpx

    if constants.is_offline_mode():
        return False
    # Not left to huggingface_hub: for a file it lacks it retries with backoff, half a minute or more per load.
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (httpx.TransportError, OfflineModeIsEnabled):  # refused, timed out, no route, proxy down
        return False
    return True  # any answer, an error status included: the hub (or its proxy) is there
