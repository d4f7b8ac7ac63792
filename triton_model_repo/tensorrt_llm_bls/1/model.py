"""Triton python model: ChatGLM3 pipeline as BLS (streaming-capable).

The implementation is trtglm.backend.bls; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.backend.bls import TritonPythonModel  # noqa: F401
