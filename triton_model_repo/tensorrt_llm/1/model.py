"""Triton python model: trtglm's PyTorch runtime as tensorrt_llm (in-flight batching, streaming, tp ranks).

Used when tensorrt_llm's backend is "python" (an engine built with build.engine torch). The
implementation is trtglm.backend.triton_model; trtglm must be importable by the python that
runs Triton's python-backend stub.
"""

from trtglm.backend.triton_model import TritonPythonModel  # noqa: F401
