"""Built-in environments (pure Python, no gRPC)."""
