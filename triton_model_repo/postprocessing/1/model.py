"""Triton python model: ChatGLM3 postprocessing: generated ids -> reply text, whole or streamed.

The implementation is trtglm.repo.python_models.postprocessing; trtglm must be importable by the
python that runs Triton's python-backend stub.
"""

from trtglm.repo.python_models.postprocessing import TritonPythonModel  # noqa: F401
