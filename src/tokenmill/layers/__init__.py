"""Shared building blocks of the models: norms, rotary embeddings, activations, paged attention."""
