"""Triton python model: ChatGLM3 preprocessing (text or chat messages -> prompt ids, word lists).

The implementation is trtglm.backend.preprocessing; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.backend.preprocessing import TritonPythonModel  # noqa: F401
