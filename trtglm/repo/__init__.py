"""The Triton model repository: rendering (`patch_repo`) and checking (`check_repo`).

`patch_repo` fills trtglm's template (triton_model_repo/) or patches a copy of NVIDIA's
inflight_batcher_llm for an engine folder; `check_repo` lists a repository's problems.
"""

from trtglm.repo.render import patch_repo
from trtglm.repo.validate import check_repo

__all__ = ["patch_repo", "check_repo"]
