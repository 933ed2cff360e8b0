"""Rendering: terminal (rich), JSON, HTML. Analyses never print; they return findings."""
