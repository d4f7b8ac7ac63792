"""trtglm's Triton python models: ChatGLM3 preprocessing, postprocessing and BLS.

The request and reply logic lives in plain functions (prompt, words, reply, preprocessing's
`preprocess`, postprocessing's `postprocess`) that tests call directly; each model's
`TritonPythonModel` only moves tensors between Triton and those functions.
"""
