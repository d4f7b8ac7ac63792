"""`python -m trtglm.openai_api`: the API's HTTP server (app.py)."""

from trtglm.openai_api.app import main

main()
