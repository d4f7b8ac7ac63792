"""What runs inside tritonserver: trtglm's Triton python models and what they need there.

- `preprocessing`, `postprocessing`, `bls`: ChatGLM3's pre/postprocessing and the BLS pipeline;
  their request and reply logic lives in plain functions (`preprocess`, `postprocess`, over
  ChatGLM3's chat format in trtglm.chatglm.chat) that tests call directly, and each model's
  `TritonPythonModel` only moves tensors between Triton and those functions. They import no
  torch: they run in tritonserver's python stubs;
- `triton_model`: trtglm's PyTorch runtime as the `tensorrt_llm` model (`llm_requests`: its
  input tensors -> the executor's requests; `llm_responses`: outputs -> its response tensors);
  the engine runs in a process of its own (`engine_process`, running `engine.ServedEngine`) and
  responses leave through `outbox`;
- `triton_io`: what the python models share (parameters, tensors, error responses, sibling stubs);
- `contract`: the serving contract as data (model and parameter names, every model's tensors,
  the ensemble's wiring), which the models take their names from and rendering checks;
- `cpus`: a physical core of its own for each engine's step loop on GPU machines (the supervisor
  plans them, the engine's process moves onto its core).

The rendered repository's `1/model.py` files import these modules by name. This package may
import trtglm.chatglm, trtglm.runtime, trtglm.engine.manifest and trtglm.errors, never
trtglm.repo (build time) or trtglm.serve (the supervisor outside tritonserver); those two read
only `contract` and `cpus` from here.
"""
