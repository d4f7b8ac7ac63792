"""Triton python model: the history API of the first ChatGLM3-on-Triton deployments.

The implementation is trtglm.backend.history_chat; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.backend.history_chat import TritonPythonModel  # noqa: F401
