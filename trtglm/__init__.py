"""trtglm: ChatGLM3 from Hugging Face weights to a served Triton endpoint."""

__version__ = "0.1.0"
