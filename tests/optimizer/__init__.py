"""Tests of optimizer."""
