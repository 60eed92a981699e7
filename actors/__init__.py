"""Thin Ray actor shells, each owning one pure core object."""
