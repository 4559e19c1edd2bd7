"""Zoo's built-in checkpoint formats: a safetensors folder (safetensors.py, with its fp8 and
MXFP4 weights: safetensors_fp8.py, safetensors_mxfp4.py) and a GGUF file (gguf.py, with its
reader, architectures, fixes, rope, tokenizer and kept quantized blocks: gguf_*.py). Each
registers through the same hook as a third-party plugin's format (`zoo_register_formats`)."""
