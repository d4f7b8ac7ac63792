"""`trtglm models load|unload|list`: Triton's model repository API over HTTP.

load: POST /v2/repository/models/NAME/load; unload: POST …/NAME/unload; list: POST
/v2/repository/index. They matter for a server in explicit model-control mode (ranks > 0 of a
launch, or a server started with `--model-control-mode=explicit`); a server polling or not
controlling its repository refuses them, which is reported as Triton words it.

A server started by `trtglm launch` answers them only with the launch's secret in the
`trtglm-api-key` header (serve/command.py): it is read from the launch state of the server at
--url (readable by the user who launched it alone), or from $TRTGLM_API_KEY.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlsplit

from trtglm.errors import DependencyError, TrtglmError, UsageError
from trtglm.serve.command import API_KEY_HEADER
from trtglm.serve.state import all_launch_dirs

log = logging.getLogger(__name__)

ACTIONS = ("load", "unload", "list")


def models(action: str, name: str | None, url: str) -> list[dict] | None:
    """Run one repository action; `list` returns the repository index, the others None."""
    if action not in ACTIONS:
        raise UsageError(f"unknown action {action!r} (choose from {', '.join(ACTIONS)})")
    if action != "list" and not name:
        raise UsageError(f"`models {action}` needs a model name")
    client = _client(url)
    from tritonclient.utils import InferenceServerException

    key = os.environ.get("TRTGLM_API_KEY") or launch_api_key(url)
    headers = {API_KEY_HEADER: key} if key else None
    try:
        if action == "load":
            client.load_model(str(name), headers=headers)
        elif action == "unload":
            client.unload_model(str(name), headers=headers)
        else:
            return client.get_model_repository_index(headers=headers)
    except OSError as e:
        raise TrtglmError(f"cannot reach Triton at {url}: {e.strerror or e}") from None
    except InferenceServerException as e:  # Triton's own message
        raise TrtglmError(f"{action} {name}: {e.message()}") from None
    finally:
        client.close()
    log.info("%s %s: done", action, name)
    return None


def launch_api_key(url: str) -> str | None:
    """The API key of the running launch that serves HTTP at `url`, if this user can read its state."""
    wanted = _netloc(url)
    for launch in all_launch_dirs():
        state = launch.read() or {}
        if _netloc(state.get("urls", {}).get("http", "")) == wanted:
            return launch.api_key()
    return None


def _netloc(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = {"localhost": "127.0.0.1", "0.0.0.0": "127.0.0.1"}.get(parts.hostname or "", parts.hostname or "")
    return f"{host}:{parts.port}"


def _client(url: str):
    try:
        import tritonclient.http as http
    except ImportError:
        raise DependencyError("tritonclient is not installed: pip install 'tritonclient[http]'") from None
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise UsageError(f"--url {url}: expected http://HOST:PORT")
    return http.InferenceServerClient(parts.netloc, ssl=parts.scheme == "https", network_timeout=600.0)
