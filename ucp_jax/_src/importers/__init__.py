"""Importers of checkpoints written by JAX libraries (Orbax) into universal checkpoints."""
