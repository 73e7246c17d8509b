"""Assignment 1: pack b-bit codes into uint8 bytes and back (see README.md beside this file).

    packed = pack(codes, bits=2, axis=-1)        # (..., n) uint8 codes -> (..., n // 4) bytes
    codes2 = unpack(packed, bits=2, n=n)         # and back

Use NumPy only.
"""

# import numpy as np    (uncomment: you will need it)


def pack(codes, bits, axis=-1):
    """Pack uint8 codes in ``[0, 2**bits)`` into bytes along ``axis``, ``8 // bits`` codes per byte.

    The i-th code of a byte sits in bits ``[bits*i, bits*i + bits)``: the first code in the low bits.

    Args:
        codes: uint8 array; ``codes.shape[axis]`` must be a multiple of ``8 // bits``.
        bits: 2 or 4.
        axis: the axis to pack along (negative values count from the end).
    Returns:
        uint8 array, C-contiguous, shaped like ``codes`` except ``shape[axis] // (8 // bits)``.
    Raises:
        ValueError: unsupported ``bits``, a length that is not a multiple of ``8 // bits``, a code
            ``>= 2**bits``, or an axis out of range.
        TypeError: ``codes`` is not uint8.
    """
    raise NotImplementedError


def unpack(packed, bits, n, axis=-1):
    """Inverse of :func:`pack`: uint8 bytes -> ``n`` uint8 codes along ``axis``.

    Args:
        packed: uint8 array of bytes made by :func:`pack`.
        bits: 2 or 4.
        n: the number of codes along ``axis``; must equal ``packed.shape[axis] * (8 // bits)``.
        axis: the axis the codes were packed along.
    Returns:
        uint8 array, C-contiguous, shaped like ``packed`` except ``shape[axis] == n``.
    Raises:
        ValueError: unsupported ``bits``, a wrong ``n``, or an axis out of range.
        TypeError: ``packed`` is not uint8.
    """
    raise NotImplementedError
