"""Analyses: pure functions from stored data to findings (plain dataclasses); no rendering."""
