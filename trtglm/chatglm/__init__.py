"""ChatGLM2/ChatGLM3 model facts: configuration, HF weights, tokenizer and the transformers reference."""
