"""PyTorch in and out: DeepSpeed ZeRO / universal folders, torch DCP and safetensors importers, and
the DeepSpeed universal exporter. The public names live in `ucp_jax.torch`."""
