"""Package build. Metadata lives in pyproject.toml; this file only exists so the CUDA extension
build (CMakeLists.txt) can be driven from here once it lands; without a CUDA toolchain the package
installs as pure Python."""

from setuptools import setup

setup()
