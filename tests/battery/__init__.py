"""The bad-input battery of issue 36: every public function of kvq.reference, kvq.fast (Triton under the
interpreter), KVStore, the HF caches and the calibration loaders, called with bad input; see README.md."""
