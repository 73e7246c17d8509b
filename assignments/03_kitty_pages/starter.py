"""Assignment 3: Kitty's key page, dense / sparse decomposition and Algorithm 1 (see README.md).

    boost = select_boost(channel_scores(kpage), d_boost=4)   # kpage: (..., G, D)
    page = encode_page(kpage, boost)                         # dict: low, high, idx, scale, mn
    k_hat = dequantize_page(page, group_size=G)              # (..., G, D) float32

Use NumPy only.
"""

# import numpy as np    (uncomment: you will need it)


def channel_scores(kpage):
    """Eq. 2 of the Kitty paper: ``s_i = (1/G) sum_t |x_{t,i}|`` per channel.

    Args:
        kpage: (..., G, D) float16 / float32 keys.
    Returns:
        (..., D) float32 scores.
    """
    raise NotImplementedError


def select_boost(scores, d_boost):
    """Boolean mask of the ``d_boost`` channels with the largest scores (ties: the lower channel wins).

    Args:
        scores: (..., D) scores. d_boost: 0 <= d_boost <= D, else ValueError.
    Returns:
        (..., D) bool, exactly ``d_boost`` True per row.
    """
    raise NotImplementedError


def encode_page(kpage, boost):
    """Quantize a key page per channel (INT4 where ``boost``, INT2 elsewhere) and split it (Fig. 3a).

    Args:
        kpage: (..., G, D) float16 / float32 keys, G a multiple of 4.
        boost: (..., D) bool, the same number of True in every row (else ValueError).
    Returns:
        dict with ``low`` (..., D, G/4) uint8, ``high`` (..., D_boost, G/4) uint8, ``idx`` (..., D) uint8,
        ``scale`` (..., D) float16 and ``mn`` (..., D) float16 (see README.md for the exact layout).
    """
    raise NotImplementedError


def dequantize_page(page, group_size):
    """Algorithm 1: a page dict (as :func:`encode_page` returns) back to fp32 keys.

    Args:
        page: dict of ``low``, ``high``, ``idx``, ``scale``, ``mn``.
        group_size: G, the page's tokens.
    Returns:
        (..., G, D) float32: ``float32(low | high[idx] << 2) * scale + mn`` (two rounded fp32 operations;
        unboosted channels, ``idx == D_boost``, have no high bits).
    """
    raise NotImplementedError
