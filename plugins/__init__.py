"""Zoo's built-in plugins: architectures (llama3.py, ...) and, in formats/, checkpoint formats."""
