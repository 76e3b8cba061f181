"""Tests of policies."""
