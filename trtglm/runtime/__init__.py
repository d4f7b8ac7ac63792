"""trtglm's PyTorch runtime for TensorRT-LLM ChatGLM checkpoints: load the rank shards, run them
tensor-parallel (in one process for now), generate, and verify against transformers."""

from trtglm.runtime.checkpoint import Checkpoint, CheckpointConfig, load_checkpoint
from trtglm.runtime.cache import KVCache
from trtglm.runtime.generate import full_logits, generate
from trtglm.runtime.model import LocalGroup, RankModel, ShardedModel, load_model

__all__ = ["Checkpoint", "CheckpointConfig", "KVCache", "LocalGroup", "RankModel", "ShardedModel",
           "full_logits", "generate", "load_checkpoint", "load_model"]
