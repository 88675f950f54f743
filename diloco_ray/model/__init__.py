"""Models: loading from the hub, a folder or a config, and building a rank's shard without the whole model."""
