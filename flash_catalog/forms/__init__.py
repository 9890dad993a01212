"""Executable forms: one implementation per file, each declared by a spec in `specs/<family>/`."""
