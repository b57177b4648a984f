"""The moespec version, in its own module so that anything can read it without importing the package root."""

__version__ = "0.1.0"
