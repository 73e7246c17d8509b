"""Tests of kvq.integrations."""
