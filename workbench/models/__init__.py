"""The Qwen3 model on the kernel library (issue: model)."""
