"""See vllm/__init__.py of this shim."""
