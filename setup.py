"""Shim for Beam's `--setup_file ./setup.py` (Dataflow workers install the project from an
sdist built by it); all metadata lives in pyproject.toml. TPU workers use the Dockerfile."""

from setuptools import setup

setup()
