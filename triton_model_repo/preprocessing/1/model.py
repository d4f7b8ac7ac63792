"""Triton python model: ChatGLM3 preprocessing (text or chat messages -> prompt ids, word lists).

The implementation is trtglm.repo.python_models.preprocessing; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.repo.python_models.preprocessing import TritonPythonModel  # noqa: F401
