"""Serving a Triton model repository: `trtglm launch`, `trtglm stop`, `trtglm models`.

command.py builds the server command lines (pure), tritonserver.py finds the binaries and
prepares the python backend, checks.py checks before starting, supervise.py runs and watches
the servers (launch_spec.py: what to launch; rank_logs.py: the ranks' logs; stubs.py: which stub or engine
process of a rank died), state.py keeps
each launch's state, launch.py is `launch`/`stop`, control.py the repository API, status.py
what `trtglm status` and `trtglm logs` read (the CLI: trtglm/cli/serve.py), openai_process.py the process of
the OpenAI-compatible API (trtglm/openai_api/) that a launch serves beside the ranks, which the supervisor
starts and watches.
"""
