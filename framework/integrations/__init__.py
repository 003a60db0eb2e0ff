"""Conventions of other libraries the framework meets (Hugging Face: `framework.integrations.hf`)."""
