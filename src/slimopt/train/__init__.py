"""Training harness pieces: model presets and data. Imports ``transformers`` lazily."""
