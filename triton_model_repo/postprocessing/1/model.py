"""Triton python model: ChatGLM3 postprocessing: generated ids -> reply text, whole or streamed.

The implementation is trtglm.backend.postprocessing; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.backend.postprocessing import TritonPythonModel  # noqa: F401
