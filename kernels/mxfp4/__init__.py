"""MXFP4 (OCP MX v1.0) weights: encode/decode (`format.py`) and matmuls on packed weights."""

from kernels.mxfp4.format import BITS_PER_ELEMENT, BLOCK, MXFP4Weight, dequantize, quantize
from kernels.mxfp4.ops import IMPLS, gmm
from kernels.mxfp4.reference import matmul

__all__ = ["BITS_PER_ELEMENT", "BLOCK", "IMPLS", "MXFP4Weight", "dequantize", "gmm", "matmul",
           "quantize"]
