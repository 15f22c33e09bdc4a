"""vllm."""
