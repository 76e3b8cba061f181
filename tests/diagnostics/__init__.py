"""Tests of diagnostics."""
