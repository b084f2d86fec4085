"""What both split kernels of decode attention share (attention.py in Triton, gluon_attention.py in
Gluon): the PTX that turns packed RTN codes into fp16 numbers."""

from triton.runtime.jit import constexpr_function


@constexpr_function
def _slot_asm(bits, slot, swap):
    """PTX: four packed bytes -> the fp16 numbers offset + code of their slot `slot` (RTN codes).
    One lop3 per register keeps the slot's bits of the low byte of each 16-bit half in place and
    ORs in the exponent of 2^(10 - bits*slot) ((a & b) | c: 0xea). Without `swap`, two prmt first
    spread bytes 0,1 and 2,3 into the halves of two registers, so element i comes from byte i.
    With `swap` the first register takes bytes 0 and 2 as they lie and the second bytes 1 and 3
    after one shift: one instruction fewer, but elements 1 and 2 trade places (attention.py's module docstring)."""
    mask = ((1 << bits) - 1) << (bits * slot)
    magic = (25 - bits * slot) << 10
    lop3 = f"{mask | mask << 16:#x}, {magic | magic << 16:#x}, 0xea;\n"
    if swap:
        return "{\n.reg .b32 hi;\nshr.b32 hi, $2, 8;\n" + f"lop3.b32 $0, $2, {lop3}lop3.b32 $1, hi, {lop3}}}"
    return (
        "{\n.reg .b32 lo, hi;\n"
        "prmt.b32 lo, $2, 0, 0x4140;\n"
        "prmt.b32 hi, $2, 0, 0x4342;\n"
        f"lop3.b32 $0, lo, {lop3}lop3.b32 $1, hi, {lop3}}}"
    )
