"""Configuration overrides shared by the integration tests: buffers small enough that every method
quantizes within a 20-40 token prompt plus 32 new tokens (head_dim 64 for BitDecoding-2)."""

from kvq.reference import bitdecoding, kitty, kivi, oscar

SMALL = {
    "FP16": {},
    "KIVI-K2V2": dict(group_size=16, residual=8),
    "KIVI-K2V2*": dict(group_size=16, residual=8, sink=4),
    "KIVI-K4V4": dict(group_size=16, residual=8),
    "Kitty": dict(group_size=16, residual=8, sink=4),
    "Kitty-Pro": dict(group_size=16, residual=8, sink=4),
    "OSCAR": dict(sink=4, window=8, page_size=16),
    "AQUA-KV": dict(sink=4, buffer=16),
    "AQUA-KV-uniform": dict(sink=4, buffer=16),
    "BitDecoding-2": dict(warps_n=1, k_group=64),           # N_r = 64 tokens; needs head_dim 64
    "BitDecoding-4": dict(warps_n=1, k_group=32),           # N_r = 32 tokens
}
#: family -> the reference module of its per-layer cache
MODULES = {"kivi": kivi, "kitty": kitty, "oscar": oscar, "bitdecoding": bitdecoding}
