"""HF ChatGLM weights → TensorRT-LLM checkpoint.

names.py maps tensor names (one table), split.py holds the tensor-parallel split rules,
writer.py drives a conversion (`convert_checkpoint`), safetensors_file.py streams
safetensors files, source.py reads HF shards row-wise, staging.py makes outputs atomic and
synth.py writes random-weight checkpoints with the real layout (`synth_model`).
"""
