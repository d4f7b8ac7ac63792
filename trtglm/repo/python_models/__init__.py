"""trtglm's Triton python models: ChatGLM3 preprocessing, postprocessing and BLS.

The request and reply logic lives in plain functions (preprocessing's `preprocess`,
postprocessing's `postprocess`, over ChatGLM3's chat format in trtglm.chatglm.chat) that tests
call directly; each model's `TritonPythonModel` only moves tensors between Triton and those
functions. They import no torch: they run in tritonserver's python stubs.
"""
