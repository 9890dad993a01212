"""The 1.5 * 2^23 trick, shared by the Triton kernels: integers and floats exchanged without conversion
instructions (I2F / F2I issue at 16/clk/SM, a quarter of the FP32 rate).

For |x| < 2^22, `x + MAGIC_FLOAT` lands in [2^23, 2^24), where the fp32 ulp is 1: the add rounds x to the nearest
integer (ties to even) in the low mantissa bits, so the bits minus MAGIC_INT are that integer, and subtracting
MAGIC_FLOAT again gives it as a float, exactly. The other way, the bits of `i + MAGIC_INT` are the float
1.5 * 2^23 + i, and subtracting MAGIC_FLOAT leaves float(i): an integer add and an FADD instead of an I2F.
"""

from __future__ import annotations

import triton.language as tl

MAGIC_FLOAT = tl.constexpr(12582912.0)   # 1.5 * 2^23
MAGIC_INT = tl.constexpr(0x4B400000)     # its bit pattern
