"""Results to ``GeneratorOutput``: the collector, its metrics and SkyRL's batched single-turn path."""
