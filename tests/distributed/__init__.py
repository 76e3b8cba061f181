"""Tests of distributed."""
