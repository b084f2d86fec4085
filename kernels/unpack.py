"""What both split kernels of decode attention share (attention.py in Triton, gluon_attention.py in
Gluon): the PTX that turns packed RTN codes into fp16 numbers."""

from triton.runtime.jit import constexpr_function


@constexpr_function
def _slot_asm(bits, slot, swap, later=0):
    """PTX: four packed bytes -> the fp16 numbers offset + code of their slot `slot` (RTN codes).
    One lop3 per register keeps the slot's bits of the low byte of each 16-bit half in place and
    ORs in the exponent of 2^(10 - bits*slot) ((a & b) | c: 0xea). Without `swap`, two prmt first
    spread bytes 0,1 and 2,3 into the halves of two registers, so element i comes from byte i.
    With `swap` the first register takes bytes 0 and 2 as they lie and the second bytes 1 and 3
    after one shift: one instruction fewer, but elements 1 and 2 trade places (attention.py's module docstring).
    With `later`, the word is first shifted down by `later` slots, so that codes that many slots on
    read as slot `slot`, with its offset."""
    mask = ((1 << bits) - 1) << (bits * slot)
    magic = (25 - bits * slot) << 10
    lop3 = f"{mask | mask << 16:#x}, {magic | magic << 16:#x}, 0xea;\n"
    word = "w" if later else "$2"
    head = f"{{\n.reg .b32 w, lo, hi;\nshr.b32 w, $2, {bits * later};\n" if later else "{\n.reg .b32 lo, hi;\n"
    if swap:
        return head + f"shr.b32 hi, {word}, 8;\nlop3.b32 $0, {word}, {lop3}lop3.b32 $1, hi, {lop3}}}"
    return (
        head + f"prmt.b32 lo, {word}, 0, 0x4140;\n"
        f"prmt.b32 hi, {word}, 0, 0x4342;\n"
        f"lop3.b32 $0, lo, {lop3}lop3.b32 $1, hi, {lop3}}}"
    )
