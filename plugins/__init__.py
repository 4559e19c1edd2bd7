"""Zoo's built-in plugins: architectures (llama3) and checkpoint formats (safetensors)."""
