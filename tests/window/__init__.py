"""Tests of window."""
