"""One test helper for the calibration-file tests: copy a ``kvq calibrate`` file with its tensors or metadata
edited (tests/test_calibration_files.py, tests/test_calibration_validation.py)."""

import json

from safetensors import safe_open
from safetensors import numpy as safetensors_numpy

from kvq import calibration as cf


def rewrite(path, out, *, tensors=None, meta=None, fix=True, raw=None):
    """Copy the calibration file ``path`` to ``out`` with its tensors (``tensors(dict)``) or decoded metadata
    (``meta(dict)``) edited in place. ``fix``: recompute BOTH checksums, so that the file passes every
    integrity check and only the content checks can refuse it. ``raw``: metadata keys replaced by these
    raw strings afterwards (malformed JSON cannot be checksummed). Returns ``out``."""
    with safe_open(str(path), framework="np") as f:
        arrays = {k: f.get_tensor(k) for k in f.keys()}
        md = {k: json.loads(v) for k, v in f.metadata().items()}
    if tensors:
        tensors(arrays)
    if meta:
        meta(md)
    if fix:
        md["checksum"] = cf.checksum(arrays)
        md["meta_checksum"] = cf._meta_checksum(md)
    text = {k: json.dumps(v) for k, v in md.items()}
    text.update(raw or {})
    safetensors_numpy.save_file(arrays, str(out), metadata=text)
    return out
