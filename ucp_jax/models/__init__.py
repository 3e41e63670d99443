"""Real model families in Flax nnx, laid out per parallel layout like :mod:`ucp_jax.demo`.

>>> from ucp_jax.models import llama  # doctest: +SKIP
"""
