"""The default ports of a launch: Triton's HTTP, gRPC and metrics ports, and the OpenAI-compatible API's beside
them; for the servers, the profiles and the clients alike."""

HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
OPENAI_PORT = 8003
TRITON_PORTS = {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT}
LOCAL_URL = f"http://127.0.0.1:{HTTP_PORT}"  # a server launched on this machine with the default ports
