"""Parity tests: every fast function against its NumPy reference (bit-exact, or the rule-7 tolerance)."""
