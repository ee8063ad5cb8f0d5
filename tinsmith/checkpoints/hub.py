"""Push an exported directory to the Hugging Face Hub (``tinsmith export --push-to-hub REPO``).

Everything goes through ``huggingface_hub`` the way its own tools do: the endpoint is
``HF_ENDPOINT`` (default https://huggingface.co), the token is the one ``huggingface_hub``
finds (``HF_TOKEN``, or the file ``hf auth login`` writes), and the upload is ``create_repo``
then one ``upload_folder`` commit, with huggingface_hub's own progress bars for the bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tinsmith.errors import InvalidInputError, TinsmithError


class HubError(TinsmithError):
    """The Hub refused or could not be reached; the message says what it answered."""


def push_folder(folder: Path, repo_id: str, private: bool = False, show_progress: bool = False) -> str:
    """Create ``repo_id`` (a model repo; kept if it exists) and commit every file of ``folder`` to it.
    Returns the commit's URL."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise InvalidInputError(f"--push-to-hub {repo_id!r} is not a repository id like NAME or ORG/NAME")
    token = get_token()
    if not token:
        raise InvalidInputError("--push-to-hub needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    if show_progress:
        enable_progress_bars()
        print(f"uploading {len(files)} files ({size / 2**20:.1f} MiB) to {api.endpoint}/{repo_id}", file=sys.stderr)
    else:
        disable_progress_bars()
    try:
        # the Hub puts a repo named without an org under the token's account: push where it says
        repo_id = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True).repo_id
        commit = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                                   commit_message="Upload tinsmith export")
    except OfflineModeIsEnabled as e:
        raise HubError(f"cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)") from e
    except HfHubHTTPError as e:
        raise HubError(f"the Hub at {api.endpoint} refused the push to {repo_id}: {e}") from e
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, TLS: the HTTP client's own classes
        raise HubError(f"cannot reach the Hub at {api.endpoint}: {type(e).__name__}: {e}") from e
    return commit.commit_url
