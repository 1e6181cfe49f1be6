"""Helpers the tests of several areas share (fixtures are in conftest.py)."""
