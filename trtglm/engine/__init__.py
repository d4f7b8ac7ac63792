"""Engine folders: `build-engine` (checkpoint → TensorRT or PyTorch engine + trtglm.json) and `plan`.

`trtglm.engine.build.build_engine`, `trtglm.engine.manifest.read_manifest` and
`trtglm.engine.plan.plan` are the entry points.
"""
