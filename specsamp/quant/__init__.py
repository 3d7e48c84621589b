"""Weights kept in their stored quantized formats, and the products computed with them."""

from specsamp.quant.blocks import (
    QWeight, dequantize, dequantize_rows, from_gguf_blocks, int8_kernel, is_quantized,
    layer_view, matmul, matmul_many,
    quantize_int8_rows, take_rows, to_qweight,
)

__all__ = ["QWeight", "dequantize", "dequantize_rows", "from_gguf_blocks", "int8_kernel",
           "is_quantized", "layer_view", "matmul", "matmul_many", "quantize_int8_rows", "take_rows", "to_qweight"]
