"""Model ids of the Hugging Face Hub (``ORG/NAME``) as checkpoint directories: the local cache first, a download
when the Hub can be reached, ``HF_HUB_OFFLINE=1`` honoured (cache only), and a clear error when neither works."""

from __future__ import annotations

import os
import re

# what hylo reads from a checkpoint: config, weights, tokenizer and chat template (never other formats' weights)
ALLOW = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not os.path.exists(name)


def resolve(name: str, revision: str | None = None) -> str:
    """A local directory for ``name``: itself when it is one, else the Hub snapshot of the repo id ``name``."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise FileNotFoundError(f"model {name!r} is a file: give the checkpoint's directory (its config.json and "
                                f"safetensors files)")
    if not looks_like_repo_id(name):
        raise FileNotFoundError(f"model directory {name!r} does not exist (and it is not a Hugging Face repo id "
                                f"like 'Qwen/Qwen3.5-9B')")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError as e:  # pragma: no cover - a dependency of hylo
        raise FileNotFoundError(f"model {name!r}: huggingface_hub is needed to resolve Hub ids ({e})") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        # the environment as it is now (huggingface_hub reads it once, at import)
        cache = os.environ.get("HF_HUB_CACHE") or None
        return snapshot_download(name, revision=revision, allow_patterns=ALLOW, local_files_only=offline,
                                 cache_dir=cache)
    except (HfHubHTTPError, OSError, ValueError) as e:
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else \
            "the local Hugging Face cache or the Hub"
        raise FileNotFoundError(f"model {name!r} is not a directory and could not be found in {where}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
