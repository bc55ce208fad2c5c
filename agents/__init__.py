"""The policy side: model loading, generation backends and the vectorized agent."""
