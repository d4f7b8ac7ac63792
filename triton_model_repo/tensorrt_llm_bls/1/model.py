"""Triton python model: ChatGLM3 pipeline as BLS (streaming-capable).

The implementation is trtglm.repo.python_models.bls; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.repo.python_models.bls import TritonPythonModel  # noqa: F401
