"""Quantized weights (`--quantization int8|w8a8|fp8`, docs/quantization.md): the schemes and their checks and the
int8 cache (schemes.py), FP8 linears (fp8.py), and FP8 checkpoints as they come (fp8_checkpoint.py)."""
