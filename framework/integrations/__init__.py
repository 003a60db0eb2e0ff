"""Conventions of other libraries the framework meets: the only package that imports
`transformers` (Hugging Face: `framework.integrations.hf`).

Rule: imports `framework.errors` and `framework.process` only. Whether a model is a transformers
model, whether it predicts the next token, its tokenizer, its config and its `save_pretrained`
directory are asked here, so that a change in transformers has one place to land.
"""
