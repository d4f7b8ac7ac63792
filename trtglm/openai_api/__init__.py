"""An OpenAI-compatible API in front of a launched Triton server (`python -m trtglm.openai_api`), which
`trtglm launch` runs beside the ranks.

Every answer comes from Triton over gRPC streaming. The request's messages go as ChatGLM3's JSON chat in
`text_input`: the served preprocessing applies ChatGLM3's template with trtglm.chatglm.chat, which counts the
prompt's tokens here too, against the engine's limits as preprocessing reads them (trtglm.backend.contract).

| module | its one job |
|---|---|
| `app.py` | the HTTP server (FastAPI under uvicorn), its routes and its process's command line |
| `answers.py` | a request's checks, its asks of Triton, and its answer, whole or as chunks, with usage |
| `protocol.py` | requests as pydantic models, and what this server refuses of them |
| `prompts.py` | requests as ChatGLM3 chats (tools included), their prompts counted against the engine's limits |
| `replies.py` | one choice's text as it arrives: stop strings, held-back text, tool calls, log probabilities |
| `streaming.py` | choices' chunks merged, and sent as server-sent events |
| `triton.py` | the gRPC client of Triton: inputs, response pieces, Triton's errors as the API's |
| `served.py` | what a repository serves: model id, answering model, tokenizer, limits |
| `errors.py` | OpenAI's error bodies and statuses |

Only `served.py` is imported by the launch (it tells whether a repository can be served); the rest needs
fastapi, uvicorn and tritonclient.
"""
