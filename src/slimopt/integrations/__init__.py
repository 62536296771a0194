"""Glue to other libraries; each module imports its library lazily (``import slimopt`` needs only
torch): ``slimopt.integrations.transformers`` for Hugging Face's Trainer."""
